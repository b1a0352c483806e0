"""Stages of our TileLang GDN forward: cumsum.py, kkt_solve.py, chunk_h.py, chunk_o.py; api.py is the entry.

Nothing here imports tilelang at package import time.
"""
