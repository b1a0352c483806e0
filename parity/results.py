"""The result file: versioned, tidy JSON Lines with the machine's metadata.

Each part of a run that writes to the file (a resumed run adds a part, numbered from 0) appends a
``{"record": "run", ...}`` header, its ``{"record": "row", ...}`` lines (one per case x backend x
against x tensor, ``against`` being "fp64" or, for pairwise rows, the other backend) and, when it
finishes, an ``{"record": "end", ...}`` line with its wall time. Each cell's rows are appended in one write and
flushed to disk, so a crash loses at most the cell in flight. One process writes a file at a time: the writer holds
an exclusive ``flock`` on ``<file>.lock`` (the kernel drops it when the holder exits or dies, so a lock file left by
a dead process never blocks). Loading tolerates damage (a torn or garbled line, a row without its key fields, a row
written twice): what is unreadable is skipped and named in ``ResultSet.problems``. Reports and comparisons are
rendered only from these files.

Row fields: run_id, part, case_id, group_id, seed, the case's configuration fields
(``cases.case.CONFIG_FIELDS``: layout, B, T, H, ... grad), backend, impl, tensor, status
(ok | nan | error | unsupported | unavailable), reason, the metrics (parity.metrics.Metrics.as_row),
wall_s, peak_mem_bytes, ref_s (time to get the fp64 reference for the case), ``at`` (unix time written) and, on
error rows the runner made for a cell that did not finish (its worker died or timed out), ``interrupted: true``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from cases.case import CONFIG_FIELDS

FORMAT = "gdn-parity-results"
VERSION = 1

STATUSES = ("ok", "nan", "error", "unsupported", "unavailable")
ROW_KEY = ("case_id", "backend", "against", "tensor")  # one row per key; a later row replaces an earlier one
ROW_REQUIRED = ("case_id", "backend", "tensor", "status")
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
    problems: list[str] = field(default_factory=list)  # 'file:line: what' for every line skipped or replaced

    def frame(self):
        """The rows as a pandas DataFrame, one per (case, backend, against, tensor): the last written wins."""
        import pandas as pd

        return pd.DataFrame(list(latest_rows(self.rows).values()))

    def cells_done(self) -> set[tuple[str, str]]:
        """(case_id, backend) pairs that have rows against fp64 (pairwise rows are not cells)."""
        return {(r["case_id"], r["backend"]) for r in self.rows if r.get("against", "fp64") == "fp64"}


def row_key(row: dict) -> tuple:
    return (row["case_id"], row["backend"], row.get("against", "fp64"), row["tensor"])


def latest_rows(rows: list[dict]) -> dict[tuple, dict]:
    """{row_key: row} where a later row with the same key replaces an earlier one (a cell run again on resume)."""
    return {row_key(r): r for r in rows}


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


class FileLocked(RuntimeError):
    """Another process holds the result file's lock."""


class WriteLock:
    """An exclusive ``flock`` on ``<path>.lock`` naming its holder (pid, host, start time) inside. The kernel
    drops a flock when its holder's file descriptor closes, including when the process dies, so a ``.lock``
    left behind by a dead process is simply taken over; the text inside only serves the error message. (flock is
    per host on most network filesystems: two hosts writing one file over NFS are not caught.)"""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> "WriteLock":
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise FileLocked(f"{self.path} is being written by another run ({holder}; lock {self.lock_path}); "
                             f"wait for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)
        self.fd = fd
        return self

    def unlock(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "WriteLock":
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc) -> None:
        self.unlock()


class ResultWriter:
    """Appends to a result file. ``header`` is written when the writer opens (a new part on resume). ``lock``:
    a WriteLock on ``path`` already held by the caller; without one the writer takes its own (FileLocked when
    another process holds it) and keeps it until ``finish`` or ``close``."""

    def __init__(self, path: str | os.PathLike, header: dict, lock: WriteLock | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._own_lock = lock is None
        self.lock = WriteLock(self.path).acquire() if lock is None else lock
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
        """Append the part's end record (wall time, counts) and drop a lock the writer took itself."""
        self._append([{"record": "end", "part": self.part, **summary}])
        self.close()

    def close(self) -> None:
        if self._own_lock:
            self.lock.unlock()


def _read_text(path: Path) -> str:
    """A result file's text; ``.gz`` files (how finished runs are kept in the repository) are decompressed."""
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            return f.read()
    return path.read_text()


def load(*paths: str | os.PathLike) -> ResultSet:
    """Read result files (several are concatenated). Raises ValueError for a missing file, a file of another format
    or a newer version. Damage is skipped and named in ``problems`` (file:line and what): a torn or garbled line, a
    row without its key fields (ROW_REQUIRED), a row before any run header, an unknown record, a row written again
    (the later one counts). A torn last line (a crash mid-write) is also counted in ``torn_lines``. Files written
    before the run part was called ``part`` name it ``session``: it is read as ``part``."""
    rs = ResultSet(path=str(paths[0]) if paths else None)
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such result file")
        try:
            lines = _read_text(Path(path)).splitlines()
        except (OSError, UnicodeDecodeError, EOFError) as err:
            raise ValueError(f"{path}: cannot read the result file ({type(err).__name__}: {err})") from None
        seen: dict[tuple, int] = {}
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            where = f"{path}:{i + 1}"
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError
            except ValueError:
                if i == len(lines) - 1:
                    rs.torn_lines += 1
                    rs.problems.append(f"{where}: torn last line (a write cut short), skipped")
                else:
                    rs.problems.append(f"{where}: not a JSON record, skipped")
                continue
            rec = {("part" if k == LEGACY_PART_KEY else k): _restore(v) for k, v in rec.items()}
            kind = rec.get("record")
            if kind == "run":
                if rec.get("format") != FORMAT:
                    raise ValueError(f"{path}: not a {FORMAT} file (format={rec.get('format')!r})")
                try:
                    version = int(rec.get("version", 0))
                except (TypeError, ValueError):
                    raise ValueError(f"{where}: run header with version {rec.get('version')!r}") from None
                if version > VERSION:
                    raise ValueError(f"{path}: result format version {rec['version']} is newer than this harness "
                                     f"reads ({VERSION}); update gdn-parity")
                rs.runs.append(rec)
            elif kind == "end":
                rs.ends.append(rec)
            elif kind == "row":
                missing = [k for k in ROW_REQUIRED if rec.get(k) in (None, "")]
                if not rs.runs:
                    rs.problems.append(f"{where}: a row before any run header, skipped")
                elif missing:
                    rs.problems.append(f"{where}: row without {', '.join(missing)}, skipped")
                else:
                    key = (rec.get("part"), *row_key(rec))  # another part's row: a cell run again
                    if key in seen:
                        rs.problems.append(f"{where}: row {'/'.join(map(str, key[1:]))} written twice in part "
                                           f"{key[0]} (first at line {seen[key]}); the later one counts")
                    seen[key] = i + 1
                    rs.rows.append(rec)
            else:
                rs.problems.append(f"{where}: unknown record {kind!r}, skipped")
        if not lines or not any(line.strip() for line in lines):
            rs.problems.append(f"{path}: empty file")
    return rs


def merge(paths: list[str | os.PathLike], out: str | os.PathLike) -> ResultSet:
    """Join result files (shards of one matrix, or several runs) into one file written atomically. When two files
    hold the same (case, backend, against, tensor), the later file's row wins; ``out`` ending in ``.gz`` is written
    gzip-compressed. The result's ``problems`` are those of the inputs (what was skipped from them)."""
    if not paths:
        raise ValueError("merge needs at least one result file")
    runs, rows = [], {}
    ends, problems = [], []
    for p in paths:
        rs = load(p)
        problems += rs.problems
        offset = len(runs)
        for r in rs.runs:
            runs.append({**r, "part": offset + r.get("part", 0), "source": str(p)})
        for r in rs.ends:
            ends.append({**r, "part": offset + r.get("part", 0)})
        for r in rs.rows:
            rows[row_key(r)] = {**r, "part": offset + r.get("part", 0)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    text = "".join(encode(rec) + "\n" for rec in runs + list(rows.values()) + ends)
    with open(tmp, "wb") as f:
        if out.suffix == ".gz":     # (how finished runs are kept: ``load`` reads it back)
            import gzip
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:
                z.write(text.encode())
        else:
            f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    merged = load(out)
    merged.problems = problems + merged.problems
    return merged


def case_fields(case) -> dict:
    """The case's configuration fields for a row (cases.case.CONFIG_FIELDS: all but the seed, its own column)."""
    return {name: getattr(case, name) for name in CONFIG_FIELDS}
