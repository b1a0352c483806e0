"""gdn-parity: Gated Delta Rule kernels against an fp64 reference.

Importing this package imports torch and the harness only; GPU packages (fla, flash_qla, tilelang)
are imported lazily by the backends that need them.
"""

__version__ = "0.1.0"
