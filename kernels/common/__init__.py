"""TileLang macros both directions share (``prologue.py``; bf16 tiles to fp16 in shared memory, ``smem_convert.py``)
and the bank-conflict model of the compile tests (``bank_conflicts.py``)."""
