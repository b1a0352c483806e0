"""The result file: versioned, tidy JSON Lines with the machine's metadata.

Each part of a run that writes to the file (a resumed run adds a part, numbered from 0) appends a
``{"record": "run", ...}`` header, its ``{"record": "row", ...}`` lines (one per case x backend x
against x tensor, ``against`` being "fp64" or, for pairwise rows, the other backend) and, when it
finishes, an ``{"record": "end", ...}`` line with its wall time. Each cell's rows are appended in one write and flushed to disk, so a
crash loses at most the cell in flight; a torn last line is ignored on load. Reports and
comparisons are rendered only from these files.

Row fields: run_id, part, case_id, group_id, seed, the case's configuration fields
(``cases.case.CONFIG_FIELDS``: layout, B, T, H, ... grad), backend, impl, tensor, status
(ok | nan | error | unsupported | unavailable), reason, the metrics (parity.metrics.Metrics.as_row),
wall_s, peak_mem_bytes, ref_s (time to get the fp64 reference for the case) and ``at`` (unix time written).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from cases.case import CONFIG_FIELDS

FORMAT = "gdn-parity-results"
VERSION = 1

STATUSES = ("ok", "nan", "error", "unsupported", "unavailable")
FLOOR_BACKEND = "fp64-rounded"  # the fp64 reference rounded to the output's dtype: the rounding floor
REFERENCE_BACKENDS = ("ref-recurrent",)  # another fp64 path: its pairwise rows repeat "vs fp64"
LEGACY_PART_KEY = "session"  # what older files call a record's run part


@dataclass
class ResultSet:
    """Everything read from one or more result files: run headers and rows."""

    runs: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    ends: list[dict] = field(default_factory=list)
    path: str | None = None
    torn_lines: int = 0

    def frame(self):
        """The rows as a pandas DataFrame (one row per case x backend x tensor)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def cells_done(self) -> set[tuple[str, str]]:
        """(case_id, backend) pairs that have rows against fp64 (pairwise rows are not cells)."""
        return {(r["case_id"], r["backend"]) for r in self.rows if r.get("against", "fp64") == "fp64"}


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _restore(value):
    if value == "inf":
        return math.inf
    if value == "-inf":
        return -math.inf
    return value


def encode(record: dict) -> str:
    """One JSON line; NaN becomes null and +-inf the strings 'inf'/'-inf' (strict JSON)."""
    return json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False, allow_nan=False)


class ResultWriter:
    """Appends to a result file. ``header`` is written when the writer opens (a new part on resume)."""

    def __init__(self, path: str | os.PathLike, header: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existing = load(self.path) if self.path.exists() else ResultSet()
        self.part = len(existing.runs)
        if existing.torn_lines:
            self._rewrite(existing)
        hdr = {"record": "run", "format": FORMAT, "version": VERSION, "part": self.part, **header}
        self._append([hdr])

    def _rewrite(self, rs: ResultSet) -> None:
        """Drop a torn tail atomically (write a temp file, then rename over the original)."""
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "w") as f:
            for rec in rs.runs + rs.rows + rs.ends:
                f.write(encode(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _append(self, records: list[dict]) -> None:
        data = "".join(encode(r) + "\n" for r in records)
        with open(self.path, "a") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def write_cell(self, rows: list[dict]) -> None:
        """Append one cell's rows in a single write, stamped with the time (so an unfinished part's span is known)."""
        now = round(time.time(), 3)
        self._append([{"record": "row", "part": self.part, "at": now, **r} for r in rows])

    def finish(self, summary: dict) -> None:
        """Append the part's end record (wall time, counts)."""
        self._append([{"record": "end", "part": self.part, **summary}])


def _read_text(path: Path) -> str:
    """A result file's text; ``.gz`` files (how finished runs are kept in the repository) are decompressed."""
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            return f.read()
    return path.read_text()


def load(*paths: str | os.PathLike) -> ResultSet:
    """Read result files (several are concatenated). Raises ValueError for a file of another format or a newer
    version; a torn last line (a crash mid-write) is skipped and counted. Files written before the run part was
    called ``part`` name it ``session``: it is read as ``part``."""
    rs = ResultSet(path=str(paths[0]) if paths else None)
    for path in paths:
        lines = _read_text(Path(path)).splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    rs.torn_lines += 1
                    continue
                raise ValueError(f"{path}:{i + 1}: not a JSON line") from None
            rec = {("part" if k == LEGACY_PART_KEY else k): _restore(v) for k, v in rec.items()}
            kind = rec.get("record")
            if kind == "run":
                if rec.get("format") != FORMAT:
                    raise ValueError(f"{path}: not a {FORMAT} file (format={rec.get('format')!r})")
                if int(rec.get("version", 0)) > VERSION:
                    raise ValueError(f"{path}: result format version {rec['version']} is newer than this harness "
                                     f"reads ({VERSION}); update gdn-parity")
                rs.runs.append(rec)
            elif kind == "end":
                rs.ends.append(rec)
            elif kind == "row":
                if not rs.runs:
                    raise ValueError(f"{path}:{i + 1}: a row before any run header")
                rs.rows.append(rec)
            else:
                raise ValueError(f"{path}:{i + 1}: unknown record {kind!r}")
    return rs


def merge(paths: list[str | os.PathLike], out: str | os.PathLike) -> ResultSet:
    """Join result files (shards of one matrix, or several runs) into one file written atomically. When two files
    hold the same (case, backend, against, tensor), the later file's row wins."""
    if not paths:
        raise ValueError("merge needs at least one result file")
    runs, rows = [], {}
    ends = []
    for p in paths:
        rs = load(p)
        offset = len(runs)
        for r in rs.runs:
            runs.append({**r, "part": offset + r.get("part", 0), "source": str(p)})
        for r in rs.ends:
            ends.append({**r, "part": offset + r.get("part", 0)})
        for r in rs.rows:
            rows[(r["case_id"], r["backend"], r.get("against"), r["tensor"])] = {**r, "part": offset + r.get("part", 0)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "w") as f:
        for rec in runs + list(rows.values()) + ends:
            f.write(encode(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return load(out)


def case_fields(case) -> dict:
    """The case's configuration fields for a row (cases.case.CONFIG_FIELDS: all but the seed, its own column)."""
    return {name: getattr(case, name) for name in CONFIG_FIELDS}
