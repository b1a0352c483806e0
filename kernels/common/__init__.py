"""TileLang macros both directions share (``prologue.py``; ordered hand-offs along a thread-block cluster,
``cluster_chain.py``) and the bank-conflict model of the compile tests (``bank_conflicts.py``)."""
