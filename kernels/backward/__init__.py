"""The backward's kernels (``prep.py``, ``dh.py``, ``dqk.py`` with its macros ``dqk_terms.py``, ``group_sum.py``,
``dg_dbeta.py``), their configurations (``configs.py``), the host pipeline (``pipeline.py``: the forward
recompute, the segmented reverse pass of ``dh_segmented.py``, the torch reductions of ``finish.py``) and its CPU
emulation (``emulation.py``).

Nothing here imports tilelang at package import time.
"""
