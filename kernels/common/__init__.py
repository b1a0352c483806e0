"""TileLang macros both directions share (``prologue.py``; bf16 tiles to fp16 in shared memory, ``smem_convert.py``;
ordered hand-offs along a thread-block cluster, ``cluster_chain.py``) and the bank-conflict model of the compile
tests (``bank_conflicts.py``)."""
