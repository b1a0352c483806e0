"""The forward's kernels (``intra_chunk.py``, ``state_smem.py``, ``state_registers.py``, ``output.py``; the gate
cumsum macro ``cumsum.py``), their configurations (``configs.py``) and precisions (``precision.py``), the host
pipeline (``pipeline.py``) and its CPU emulation (``emulation.py``).

Nothing here imports tilelang at package import time.
"""
