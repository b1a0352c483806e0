"""Stages of our TileLang GDN forward (the v2 "split2" path): cumsum.py (macro), intra2.py, state2.py /
state3.py, output2.py; build.py compiles and dispatches; api.py is the entry.

Nothing here imports tilelang at package import time.
"""
