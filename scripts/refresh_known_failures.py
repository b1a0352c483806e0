"""Rewrite the ``case`` lists of tests/known_failures.json from measured results.

    python scripts/refresh_known_failures.py RESULTS.jsonl[.gz] [...] [--write]

For every entry, the cells of its ``scope`` (a glob over case ids; taken from ``case`` when the
entry still holds one glob) that FAIL or ERROR in the results (any tensor but the attribution
tensor ``h``, as the pytest matrix judges them) become its ``case`` list, so that a strict xfail
marks exactly the cells measured to fail: an upstream defect that depends on the data (FlashQLA's
gate-cumsum rounding passes the bound on slow-decay or strong-decay inputs) is not an expected
failure where it passes.  Prints the cells that fail outside every entry's scope (new defects: add
an entry by hand, with a reason and a link) and the entries that match no failing cell.
Without ``--write`` nothing is written.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

KNOWN = os.path.join(ROOT, "tests", "known_failures.json")


def failing_cells(paths) -> dict[tuple[str, str], str]:
    """(case id, backend) -> worst verdict (FAIL / ERROR) over the tensors the pytest matrix judges."""
    from parity import results, verdicts

    df = results.load(*paths).frame()  # a cell run again on resume: its latest rows
    judged = verdicts.judge_frame(df)
    judged = judged[(judged["tensor"] != "h") & judged["verdict"].isin([verdicts.FAIL, verdicts.ERROR])]
    out = {}
    for r in judged.itertuples():
        key = (r.case_id, r.backend)
        if out.get(key) != verdicts.FAIL:
            out[key] = r.verdict
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    entries = json.load(open(KNOWN))
    failing = failing_cells(args.results)
    covered = set()
    for e in entries:
        scope = e.get("scope") or (e["case"] if isinstance(e["case"], str) else None)
        if scope is None:
            print(f"entry {e['backend']} has a case list and no scope: kept as is")
            continue
        e["scope"] = scope
        ids = sorted(c for (c, b) in failing if b == e["backend"] and fnmatch.fnmatchcase(c, scope))
        covered.update((c, e["backend"]) for c in ids)
        if not ids:
            print(f"entry {e['backend']} {scope}: no failing cell in these results")
        e["case"] = ids
        print(f"entry {e['backend']} {scope}: {len(ids)} failing cells")
    new = sorted(set(failing) - covered)
    for c, b in new:
        print(f"NOT COVERED: {b} {c} ({failing[(c, b)]})")
    if args.write:
        ordered = [{k: e[k] for k in ("backend", "scope", "reason", "link", "case") if k in e} for e in entries]
        with open(KNOWN, "w") as f:
            json.dump(ordered, f, indent=2)
            f.write("\n")
        print(f"wrote {KNOWN}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
