"""Our TileLang GDN backward (Hopper, sm_90a): dq, dk, dv, dg, dbeta, dh0 from do and dht.

Stages (see ``README.md`` in this folder): forward recompute of the chunk states (the forward's
intra2 + state kernels), ``prep.py`` (parallel: (I + A)^-1, gate table, P^T dO), ``dh.py``
(reverse sequential: dS, dU, dY, dv, dh0), ``dqk.py`` (parallel: the local dq, dk, dg, dbeta
terms), then a few host-side torch reductions (``common.finish``).  ``emulation.py`` replays
every stage in torch with the same roundings; ``autograd.py`` is the ``torch.autograd.Function``.

Nothing here imports tilelang at package import time.
"""
