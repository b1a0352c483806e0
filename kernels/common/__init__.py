"""TileLang macros both directions share (``prologue.py``) and the bank-conflict model of the compile tests
(``bank_conflicts.py``)."""
