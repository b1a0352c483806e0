"""``tests/known_failures.json``: upstream defects measured by the harness, one entry per (backend, defect).

Entries: backend, case, reason, link (all required), scope (optional: the glob of cases the defect can touch, for
the reader) and strict (optional, default true: false where the defect shows on some runs only).  ``case`` is a
glob over the case id or a list of them: the cells measured to fail.  The test suite turns entries into expected
failures (conftest.py); the report's findings quote their reason and link.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

PATH = Path(__file__).resolve().parent.parent / "tests" / "known_failures.json"
REQUIRED = ("backend", "case", "reason", "link")


def load(path: str | Path = PATH) -> list[dict]:
    """The entries, each ``case`` a list; [] when the file is absent; ValueError naming the file when it is not a
    JSON list of complete entries."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of entries, got {type(entries).__name__}")
    for e in entries:
        missing = set(REQUIRED) - set(e) if isinstance(e, dict) else set(REQUIRED)
        if missing:
            raise ValueError(f"{path}: entry {e} lacks {sorted(missing)}")
        if isinstance(e["case"], str):
            e["case"] = [e["case"]]
    return entries


def match(known: list[dict], case_id: str, backend: str) -> int | None:
    """Index of the first entry of ``known`` that matches (case id, backend), or None."""
    for i, e in enumerate(known):
        if e["backend"] == backend and any(fnmatch.fnmatchcase(case_id, c) for c in e["case"]):
            return i
    return None


def cause(known: list[dict], case_id: str, backend: str) -> str:
    """'reason (link)' of the matching entry, else ''."""
    i = match(known, case_id, backend)
    return "" if i is None else f"{known[i]['reason']} ({known[i]['link']})"


__all__ = ["PATH", "load", "match", "cause"]
