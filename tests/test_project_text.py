"""The tracked files describe the software (keyed by commit and GPU), not the course of its making."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# split so that this file does not match itself
WORDS = re.compile("sess" + r"ion [0-9]+|" + "ca" + r"ll [0-9]|" + "device " + "time|" + "le" + "ase", re.IGNORECASE)
# generated reports quote what a run printed
EXCLUDED = ("reports/",)


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_speaks_of_how_it_was_made():
    hits = []
    for rel in _tracked():
        if rel.startswith(EXCLUDED):
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary data, or deleted in the working tree
        hits += [f"{rel}:{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1)
                 if WORDS.search(line)]
    assert not hits, f"{len(hits)} line(s) of tracked files describe the making, not the software:\n" + "\n".join(
        hits[:40])


def test_the_pattern_finds_what_it_should():
    for line in ("measured in sess" "ion 4", "H200 ca" "ll 3", "1609 s of device " "time", "a le" "ase's results"):
        assert WORDS.search(line), line
    assert not WORDS.search("the pytest session fixture; one call per cell")
