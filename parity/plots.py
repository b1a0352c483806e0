"""Figures for the report, drawn only from result rows into ``<report dir>/plots/*.png``.

- ``sweep-NN-*.png`` (a): rel_rmse against T (log-log) for every T sweep (a configuration run at several T: every
  case field but T equal), one panel per tensor, one line per backend: the worst over seeds (solid, markers) and
  the median over seeds (dashed). The rounding floor ``fp64-rounded`` (black) and the same-precision baseline
  ``torch-emulated`` (grey) are drawn; ``ref-recurrent`` (fp64, ~1e-15) is left out.
- ``pos-NN-*.png`` (b): rel_rmse by token position (16 bins of each sequence, parity.positional) at the longest T
  of each sweep, worst over seeds per bin.
- ``heads-NN-*.png`` (c): rel_rmse per head of the worst cells (the cell with the highest rel_rmse over the
  rounding floor of each judged backend and tensor, the MAX_HEAD_PLOTS worst), next to the baseline and the floor
  on the same case.

At most MAX_PNGS files: head plots first, then two per sweep in priority order (plain dense sweeps of the main
distributions first); sweeps past the bound are listed as not drawn. matplotlib is imported only here, lazily,
with the Agg canvas (no pyplot, no display); without it ``render`` returns no figures and says why.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from cases.case import CONFIG_FIELDS
from parity.backends import BASELINE
from parity.positional import N_BINS, decode
from parity.results import FLOOR_BACKEND

MAX_PNGS = 30
MAX_HEAD_PLOTS = 6
LEFT_OUT = ("ref-recurrent",)  # fp64: ~1e-15, it would only stretch the axis
PREFIXES = ("sweep-", "pos-", "heads-")
TENSOR_ORDER = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
MAIN_DISTS = ("qwen-gates", "gauss-l2")
COLORS = {FLOOR_BACKEND: "black", BASELINE: "0.55", "fla-triton": "C0", "fla-dispatch": "C1", "fla-recurrent": "C2",
          "flash-qla": "C3", "tilelang": "C4"}
SHAPE_COLS = [c for c in CONFIG_FIELDS if c != "T"]  # a sweep's configuration: everything but T


@dataclass
class Sweep:
    """A configuration run at several T: its fields (all but T), a title, and its ok rows against fp64."""

    cfg: dict
    rows: pd.DataFrame
    title: str = ""
    slug: str = ""

    @property
    def T_max(self) -> int:
        return int(self.rows["T"].max())

    @property
    def varlen(self) -> bool:
        return str(self.cfg["layout"]).startswith("varlen")


@dataclass
class Figures:
    """What ``render`` drew: (sweep, path of (a), path of (b) or None), head plots (title, path), and notes."""

    sweeps: list[tuple[Sweep, str, str | None]] = field(default_factory=list)
    heads: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    note: str = ""


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:80]


def _title(cfg: dict) -> str:
    h0 = "" if cfg["h0_dtype"] in (None, "none") else f" h0 {cfg['h0_dtype']}"
    return (f"{cfg['dist']}, {cfg['dtype']} g {cfg['g_dtype']} beta {cfg['beta_dtype']}{h0}, {cfg['layout']} "
            f"B={cfg['B']} H={cfg['H']} HV={cfg['HV']} K={cfg['K']} V={cfg['V']}"
            f"{', V-first' if cfg['state_v_first'] else ''}{', grad' if cfg['grad'] else ''}")


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["against"] == "fp64") & (df["status"] == "ok")]


def sweeps(df: pd.DataFrame) -> list[Sweep]:
    """Every configuration with ok rows against fp64 at two or more T, in priority order: no gradients, dense,
    the main distributions, more T values first."""
    ok = _ok(df)
    if ok.empty:
        return []
    out = []
    for key, g in ok.groupby(SHAPE_COLS, dropna=False):
        if g["T"].nunique() < 2:
            continue
        cfg = dict(zip(SHAPE_COLS, key))
        sw = Sweep(cfg=cfg, rows=g, title=_title(cfg))
        out.append(sw)

    def rank(s: Sweep):
        c = s.cfg
        main = MAIN_DISTS.index(c["dist"]) if c["dist"] in MAIN_DISTS else len(MAIN_DISTS)
        return (bool(c["grad"]), c["layout"] != "dense", main, -s.rows["T"].nunique(), s.title)

    out.sort(key=rank)
    for i, s in enumerate(out):
        s.slug = f"{i + 1:02d}-{_slug(s.title)}"
    return out


def _tensors(rows: pd.DataFrame) -> list[str]:
    present = set(rows["tensor"])
    return [t for t in TENSOR_ORDER if t in present] + sorted(present - set(TENSOR_ORDER))


def _color(backend: str, others: list[str]) -> str:
    if backend in COLORS:
        return COLORS[backend]
    return f"C{5 + others.index(backend) % 5}" if backend in others else "C9"


MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">")


def _marker(backend: str, backends: list[str]) -> dict:
    """A marker per backend; every other one hollow, so that backends with the same values stay distinguishable."""
    i = backends.index(backend) if backend in backends else 0
    return {"marker": MARKERS[i % len(MARKERS)], "markersize": 5.5 - 0.4 * (i % 4),
            "markerfacecolor": "none" if i % 2 else None}


def _t_ticks(ax, Ts) -> None:
    Ts = sorted({int(t) for t in Ts})
    ax.set_xticks(Ts)
    ax.set_xticklabels([f"{t // 1024}k" if t >= 4096 and t % 1024 == 0 else str(t) for t in Ts], fontsize=7)
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())


def _order(backends) -> list[str]:
    first = [b for b in (FLOOR_BACKEND, BASELINE) if b in backends]
    return first + sorted(b for b in backends if b not in first and b not in LEFT_OUT)


def _finite_pos(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y) and y > 0]
    return [p[0] for p in pts], [p[1] for p in pts]


def _log_scale(ax) -> bool:
    """A log y axis when the axis holds a positive finite value (matplotlib refuses one without); otherwise a note
    on the empty panel. True when set."""
    values = [float(v) for line in ax.get_lines() for v in line.get_ydata()]
    values += [float(p.get_height()) for p in ax.patches]
    if any(math.isfinite(v) and v > 0 for v in values):
        ax.set_yscale("log")
        return True
    ax.text(0.5, 0.5, "no positive finite value", transform=ax.transAxes, ha="center", va="center", fontsize=8)
    return False


def _panels(n: int):
    from matplotlib.figure import Figure

    ncols = 1 if n == 1 else 2
    nrows = math.ceil(n / ncols)
    width, height = 5.4 * ncols + 2.2, 0.5 + 3.6 * nrows  # 2.2 inches on the right for the legend
    fig = Figure(figsize=(width, height))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    fig.subplots_adjust(left=1.0 / width, right=1 - 2.3 / width, bottom=0.55 / height, top=1 - 0.5 / height,
                        wspace=0.28, hspace=0.45)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _style_legend(fig, axes, seeds_note: bool = False):
    from matplotlib.lines import Line2D

    handles, labels = axes[0].get_legend_handles_labels()
    if seeds_note:
        handles += [Line2D([], [], color="0.3"), Line2D([], [], color="0.3", linestyle="--")]
        labels += ["solid: worst over seeds", "dashed: median over seeds"]
    if handles:
        fig.legend(handles, labels, fontsize=7, loc="center right", frameon=False)


def plot_sweep(sw: Sweep, nan_rows: pd.DataFrame, path: Path) -> None:
    """(a): rel_rmse vs T, worst (solid) and median (dashed) over seeds, a panel per tensor."""
    tensors = _tensors(sw.rows)
    fig, axes = _panels(len(tensors))
    backends = _order(set(sw.rows["backend"]) | set(nan_rows["backend"]))
    others = [b for b in backends if b not in COLORS]
    for ax, tensor in zip(axes, tensors):
        sub = sw.rows[sw.rows["tensor"] == tensor]
        for b in backends:
            g = sub[sub["backend"] == b]
            bad = sorted(int(t) for t in nan_rows[(nan_rows["backend"] == b) & (nan_rows["tensor"] == tensor)]["T"])
            label = b + (f" (NaN/Inf at T={','.join(map(str, bad))})" if bad else "")
            if g.empty:
                if bad:
                    ax.plot([], [], color=_color(b, others), label=label)
                continue
            agg = g.groupby("T")["rel_rmse"].agg(["max", "median"]).reset_index()
            color = _color(b, others)
            x, y = _finite_pos(agg["T"], agg["max"])
            ax.plot(x, y, color=color, label=label, linewidth=2.0 if b in (FLOOR_BACKEND, BASELINE) else 1.3,
                    **_marker(b, backends))
            x, y = _finite_pos(agg["T"], agg["median"])
            ax.plot(x, y, linestyle="--", color=color, linewidth=0.9)
        if _log_scale(ax):
            ax.set_xscale("log")
            _t_ticks(ax, sw.rows["T"])
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(f"rel_rmse of {tensor} vs fp64")
        ax.set_title(tensor, fontsize=9)
        ax.grid(True, alpha=0.3)
    _style_legend(fig, axes, seeds_note=True)
    fig.suptitle(sw.title, fontsize=9)
    fig.savefig(path, dpi=90)


def _pos_matrix(rows: pd.DataFrame) -> list[list[float]]:
    out = []
    for v in rows["pos_rel_rmse"] if "pos_rel_rmse" in rows else []:
        vals = decode(v)
        if vals is not None and len(vals) == N_BINS:
            out.append(vals)
    return out


def _nanmax(cols: list[list[float]]) -> list[float]:
    res = []
    for i in range(N_BINS):
        vals = [c[i] for c in cols if not math.isnan(c[i])]
        res.append(max(vals) if vals else math.nan)
    return res


def has_positions(rows: pd.DataFrame) -> bool:
    return "pos_rel_rmse" in rows and any(decode(v) is not None for v in rows["pos_rel_rmse"])


def plot_positions(sw: Sweep, path: Path) -> bool:
    """(b): rel_rmse per position bin at the longest T, worst over seeds per bin. False if nothing to draw."""
    at = sw.rows[sw.rows["T"] == sw.T_max]
    tensors = [t for t in _tensors(at) if _pos_matrix(at[at["tensor"] == t])]
    if not tensors:
        return False
    fig, axes = _panels(len(tensors))
    backends = _order(set(at["backend"]))
    others = [b for b in backends if b not in COLORS]
    T = sw.T_max
    centers = [(i + 0.5) / N_BINS for i in range(N_BINS)]
    xs = centers if sw.varlen else [c * T for c in centers]
    for ax, tensor in zip(axes, tensors):
        sub = at[at["tensor"] == tensor]
        for b in backends:
            mat = _pos_matrix(sub[sub["backend"] == b])
            if not mat:
                continue
            x, y = _finite_pos(xs, _nanmax(mat))
            ax.plot(x, y, drawstyle="steps-mid", color=_color(b, others), label=b,
                    linewidth=2.0 if b in (FLOOR_BACKEND, BASELINE) else 1.3, **_marker(b, backends))
        _log_scale(ax)
        ax.set_xlabel("position in the sequence (fraction of its length)" if sw.varlen
                      else f"token position (bins of T/{N_BINS} = {T / N_BINS:g} tokens)")
        ax.set_ylabel(f"rel_rmse of {tensor} in the bin")
        ax.set_title(f"{tensor} at T={T}", fontsize=9)
        ax.grid(True, alpha=0.3)
    _style_legend(fig, axes)
    fig.suptitle(f"{sw.title}: error by position, worst over seeds", fontsize=9)
    fig.savefig(path, dpi=90)
    return True


def worst_head_cells(df: pd.DataFrame, n: int = MAX_HEAD_PLOTS) -> list[dict]:
    """The cell with the highest rel_rmse over its rounding floor of each (judged backend, tensor) that has per-head
    values, the ``n`` worst, each with the baseline's and the floor's rows on the same case."""
    ok = _ok(df)
    if ok.empty or "head_rel_rmse" not in ok:
        return []
    index = {(c, b, t): r for c, b, t, r in zip(ok["case_id"], ok["backend"], ok["tensor"], ok.to_dict("records"))}
    best: dict[tuple, dict] = {}
    for r in index.values():
        if r["backend"] in (FLOOR_BACKEND, BASELINE, *LEFT_OUT) or decode(r.get("head_rel_rmse")) is None:
            continue
        floor = index.get((r["case_id"], FLOOR_BACKEND, r["tensor"]))
        fl = floor["rel_rmse"] if floor else math.nan
        score = r["rel_rmse"] / fl if fl and fl > 0 and math.isfinite(fl) else r["rel_rmse"]
        if not math.isfinite(score):
            continue
        key = (r["backend"], r["tensor"])
        if key not in best or score > best[key]["score"]:
            best[key] = {"row": r, "score": score, "floor": floor,
                         "base": index.get((r["case_id"], BASELINE, r["tensor"]))}
    return sorted(best.values(), key=lambda c: -c["score"])[:n]


def plot_heads(cell: dict, path: Path) -> str:
    """(c): grouped bars per head: the backend, the baseline and the floor on the same case. Returns a title."""
    r = cell["row"]
    series = [(r["backend"], decode(r["head_rel_rmse"]))]
    for other in (cell["base"], cell["floor"]):
        if other is not None and decode(other.get("head_rel_rmse")) is not None:
            series.append((other["backend"], decode(other["head_rel_rmse"])))
    H = len(series[0][1])
    from matplotlib.figure import Figure

    width = max(7.0, min(16.0, 0.35 * H * len(series)))
    fig = Figure(figsize=(width, 3.9))
    ax = fig.subplots()
    fig.subplots_adjust(left=1.0 / width, right=1 - 0.2 / width, bottom=0.14, top=0.84)
    width = 0.8 / len(series)
    others = [s[0] for s in series if s[0] not in COLORS]
    for k, (name, vals) in enumerate(series):
        xs = [h + (k - (len(series) - 1) / 2) * width for h in range(H)]
        ys = [v if math.isfinite(v) and v > 0 else float("nan") for v in vals[:H]]
        ax.bar(xs, ys, width=width, color=_color(name, others), label=name)
    _log_scale(ax)
    ax.set_xlabel("head")
    ax.set_ylabel(f"rel_rmse of {r['tensor']} in the head")
    ax.set_xticks(range(H))
    ax.tick_params(axis="x", labelsize=6 if H > 16 else 8)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    title = (f"{r['backend']} {r['tensor']}: rel_rmse {r['rel_rmse']:.2e} = {cell['score']:.1f}x the rounding floor, "
             f"case {r['case_id']}")
    fig.suptitle(title.replace(", case ", "\ncase "), fontsize=8)
    fig.savefig(path, dpi=90)
    return title


def render(df: pd.DataFrame, out_dir: str | Path, max_pngs: int = MAX_PNGS) -> Figures:
    """Draw the figures of ``df`` (a report frame) into ``out_dir``/plots, within ``max_pngs`` files. Earlier
    figures of this module in that folder are removed first."""
    figs = Figures()
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as err:
        figs.note = f"matplotlib is not importable ({err}); install it (`pip install matplotlib`) to get the figures"
        return figs
    plot_dir = Path(out_dir) / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    for old in plot_dir.glob("*.png"):
        if old.name.startswith(PREFIXES):
            old.unlink()
    nan_rows = df[(df["against"] == "fp64") & (df["status"] == "nan")]
    cells = worst_head_cells(df, min(MAX_HEAD_PLOTS, max_pngs))
    budget = max_pngs - len(cells)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # empty-axis and log-scale warnings on sparse data
        for sw in sweeps(df):
            cost = 2 if has_positions(sw.rows) else 1
            if cost > budget:
                figs.skipped.append(f"{sw.title} (over the limit of {max_pngs} figures)")
                continue
            a = plot_dir / f"sweep-{sw.slug}.png"
            b = plot_dir / f"pos-{sw.slug}.png"
            try:  # one figure that cannot be drawn costs that figure only
                plot_sweep(sw, nan_rows[_same_cfg(nan_rows, sw.cfg)], a)
                budget -= 1
                drew = cost == 2 and plot_positions(sw, b)
            except Exception as err:  # noqa: BLE001
                figs.skipped.append(f"{sw.title} ({type(err).__name__}: {err})")
                continue
            budget -= int(drew)
            figs.sweeps.append((sw, f"plots/{a.name}", f"plots/{b.name}" if drew else None))
        for i, cell in enumerate(cells):
            r = cell["row"]
            p = plot_dir / f"heads-{i + 1:02d}-{_slug(r['backend'] + '-' + r['tensor'])}.png"
            try:
                figs.heads.append((plot_heads(cell, p), f"plots/{p.name}"))
            except Exception as err:  # noqa: BLE001
                figs.skipped.append(f"per-head figure of {r['backend']} {r['tensor']} on {r['case_id']} "
                                    f"({type(err).__name__}: {err})")
    return figs


def _same_cfg(rows: pd.DataFrame, cfg: dict) -> pd.Series:
    mask = pd.Series(True, index=rows.index)
    for k, v in cfg.items():
        col = rows[k]
        mask &= col.isna() if (v is None or (isinstance(v, float) and math.isnan(v))) else (col == v)
    return mask
