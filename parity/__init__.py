"""gdn-parity: Gated Delta Rule kernels against an fp64 reference.

Importing this package imports torch and the harness only; GPU packages (fla, flash_qla, tilelang)
are imported lazily by the backends that need them. ``parity.assert_close`` (parity/assert_close.py) is
exported lazily: nothing is imported until it is first used.
"""

__version__ = "0.1.0"
__all__ = ["assert_close", "__version__"]


def __getattr__(name: str):
    if name == "assert_close":
        from parity.assert_close import assert_close

        globals()["assert_close"] = assert_close
        return assert_close
    raise AttributeError(f"module 'parity' has no attribute {name!r}")
