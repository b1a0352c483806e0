"""Shared-memory bank conflicts of a TileLang kernel, worked out from its generated CUDA on a machine with no GPU.

TileLang lowers a fragment <-> shared copy to one vector access per thread and unrolled step, with the address an
integer expression of ``threadIdx.x`` and the loop variables, e.g.::

    *(uint1*)(((bfloat16_t*)sl_s) + ((((i_5 >> 3) * 2048) + ... + ((((int)threadIdx.x) & 3) * 2)) - 2048)) = ...

``access_sites(src, buffer)`` finds every such access of one shared buffer (``*(VEC*)(((ELEM*)buf) + EXPR)`` and
``((ELEM*)buf)[EXPR]``) and ``site_degree`` evaluates its address for the 32 lanes of every warp and every value of
the loop variables, and counts, per phase of the request, the most distinct 4-byte words that fall in one of the 32
banks: 1 is conflict-free, 4 is a 4-way conflict.  The phases follow the hardware's rule for the access width: a
whole warp for 1-, 2- and 4-byte accesses, half-warps for 8-byte ones, quarter-warps for 16-byte ones.

``ldmatrix`` / ``stmatrix`` (``tl::ptx_stmatrix_m8n8_x4(&((T*)buf)[EXPR], ...)``: EXPR is the lane's row) count
as 16-byte accesses, a matrix of 8 rows a phase.  What it does not see: wgmma descriptor / TMA / ``cp.async``
accesses (their addresses are not spelled out per lane in the source), accesses through a pointer bound to a local name, and
addresses with a ternary (reported as not evaluated).  The loop variables run over 0..15 (enough for the unrolled
copies of the kernels here, whose steps repeat with a period that divides 16); every other name in an address
(a pipeline stage, a runtime size) is uniform across a warp, so it is set to 0 and 1 in turn.  Negative addresses
(a warp outside the warpgroup the access belongs to, in warp-specialised kernels) are skipped.

From the shell: ``python -m kernels.common.bank_conflicts bwd_dqk`` (every compile-test configuration whose name
contains the pattern, compiled for sm_90a or taken from TileLang's cache; no GPU) or ``--source FILE.cu``: a line per
shared buffer, its worst degree and the sites worse than conflict-free.

A model, not a measurement: Nsight Compute's ``l1tex__data_bank_conflicts_pipe_lsu_mem_shared`` counts are the
measured numbers (``scripts/gpu_steps.sh profile``).
"""

from __future__ import annotations

import ast
import itertools
import operator
import re
from dataclasses import dataclass

__all__ = ["Site", "access_sites", "site_degree", "buffer_degrees", "warp_degree", "threads_of", "shared_buffers",
           "worst_degrees"]

_VEC_BYTES = {"uint1": 4, "uint2": 8, "uint4": 16, "int": 4, "float": 4, "float2": 8, "float4": 16, "int2": 8,
              "int4": 16, "half_t": 2, "bfloat16_t": 2, "half": 2, "__nv_bfloat16": 2, "ushort": 2, "uchar": 1,
              "char": 1, "signed char": 1, "uint": 4, "unsigned int": 4}
_ELEM_BYTES = {"bfloat16_t": 2, "half_t": 2, "float": 4, "int": 4, "uint": 4, "signed char": 1, "uchar": 1,
               "char": 1, "double": 8, "int64_t": 8, "uint64_t": 8, "fp8_e4_t": 1, "fp8_e5_t": 1}
_TX = "((int)threadIdx.x)"
# ldmatrix / stmatrix: every lane gives the address of one 16-byte row of an 8x8 matrix, a matrix (8 lanes) a phase
_MATRIX = re.compile(r"ptx_(ld|st)matrix\w*\(\(*&\(*$")
_LOOP_VAR = re.compile(r"^(i|j|k|ax|v|vec)(_\d+)?$|^i\d*_\d+$")


@dataclass(frozen=True)
class Site:
    """One access of a shared buffer in the source: its line (1-based), width in bytes, element size in bytes,
    address expression in elements (C syntax) and whether it is a store."""
    line: int
    width: int
    elem: int
    expr: str
    store: bool


def _closing(s: str, start: int) -> int:
    """Index just past the group that opens at ``s[start]`` (``(`` or ``[``) and its matching close."""
    opener = s[start]
    closer = {"(": ")", "[": "]"}[opener]
    depth = 0
    for i in range(start, len(s)):
        if s[i] == opener:
            depth += 1
        elif s[i] == closer:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {opener}{closer}")


def _is_store(line: str, end: int) -> bool:
    rest = line[end:].lstrip()
    return rest.startswith("=") and not rest.startswith("==")


def access_sites(src: str, buffer: str) -> list[Site]:
    """Every per-lane access of shared buffer ``buffer`` in generated CUDA ``src`` (see the module docstring)."""
    sites = []
    base = re.compile(r"\(\((?P<elem>[\w ]+)\*\)" + re.escape(buffer) + r"\)")
    for ln, line in enumerate(src.splitlines(), 1):
        for m in base.finditer(line):
            elem = _ELEM_BYTES.get(m.group("elem").strip())
            if elem is None:
                continue
            after = m.end()
            rest = line[after:]
            if rest.startswith("["):                                  # ((T*)buf)[EXPR]: one element
                close = _closing(line, after)
                if re.search(r"&\(*$", line[:m.start()]):                # &((T*)buf)[EXPR]: an address taken,
                    mm = _MATRIX.search(line[:m.start()])             # a lane's row of ldmatrix / stmatrix
                    if mm:
                        sites.append(Site(ln, 16, elem, line[after + 1:close - 1], mm.group(1) == "st"))
                    continue
                sites.append(Site(ln, elem, elem, line[after + 1:close - 1], _is_store(line, close)))
                continue
            if not rest.startswith(" + "):
                continue
            e0 = after + 3
            if line[e0] == "(":
                e1 = _closing(line, e0)
            else:                                                      # a bare name or number
                e1 = e0 + len(re.match(r"[\w.]+", line[e0:]).group(0))
            expr = line[e0:e1]
            # the enclosing vector cast: *(VEC*)( ((T*)buf) + EXPR )
            head = line[:m.start()]
            vm = re.search(r"\*\((?P<vec>[\w ]+)\*\)\($", head)
            if vm is None:
                continue                                               # an address taken (&, a wgmma descriptor, TMA)
            width = _VEC_BYTES.get(vm.group("vec").strip())
            if width is None:
                continue
            close = e1 + 1 if line[e1:e1 + 1] == ")" else e1
            sites.append(Site(ln, width, elem, expr, _is_store(line, close)))
    return sites


def _to_python(expr: str) -> str:
    e = expr.replace(_TX, "tx").replace("(int64_t)", "").replace("(int)", "").replace("(uint)", "")
    return re.sub(r"(?<![/])/(?![/])", "//", e)


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


def integer_expression(py: str):
    """A function of an environment {name: int} evaluating ``py``, an expression of integer literals, names and
    the operators + - * // % << >> & | ^ (unary - + ~) only; ``SyntaxError`` for anything else.  Evaluating it
    with a name missing from the environment raises ``KeyError``."""
    tree = ast.parse(py, mode="eval")

    def build(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            v = node.value
            return lambda env: v
        if isinstance(node, ast.Name):
            n = node.id
            return lambda env: env[n]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            f, a, b = _BINOPS[type(node.op)], build(node.left), build(node.right)
            return lambda env: f(a(env), b(env))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            f, a = _UNOPS[type(node.op)], build(node.operand)
            return lambda env: f(a(env))
        raise SyntaxError(f"not integer arithmetic: {ast.dump(node)[:80]}")

    return build(tree.body)


def warp_degree(byte_addrs: list[int], width: int) -> int:
    """Most distinct 4-byte words in one bank, over the phases of one warp's request (lanes in order)."""
    lanes = {1: 32, 2: 32, 4: 32, 8: 16, 16: 8}[width]
    worst = 1
    for p in range(0, len(byte_addrs), lanes):
        banks: dict[int, set[int]] = {}
        for a in byte_addrs[p:p + lanes]:
            for w in range(a // 4, (a + width - 1) // 4 + 1):
                banks.setdefault(w % 32, set()).add(w)
        worst = max(worst, max(len(s) for s in banks.values()))
    return worst


def site_degree(site: Site, threads: int, loop_range: int | None = None) -> int | None:
    """Worst conflict degree of ``site`` over every warp of ``threads`` and every loop value (0 .. loop_range - 1;
    by default 16, or 4 for sites with three or more loop variables, which keeps each site under a second); None
    when its address cannot be evaluated (a ternary, a function call)."""
    py = _to_python(site.expr)
    if "?" in py:
        return None
    names = sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", py)) - {"tx"})
    loops = [n for n in names if _LOOP_VAR.match(n)]
    others = [n for n in names if n not in loops]
    if loop_range is None:
        loop_range = 16 if len(loops) <= 2 else 4
    try:
        address = integer_expression(py)
    except SyntaxError:
        return None
    worst = 0
    for lv in itertools.product(range(loop_range), repeat=len(loops)):
        for ov in itertools.product((0, 1), repeat=len(others)):
            env = dict(zip(loops, lv), **dict(zip(others, ov)))
            for w0 in range(0, threads, 32):
                try:
                    addrs = [address(dict(env, tx=w0 + lane)) * site.elem for lane in range(32)]
                except Exception:
                    return None
                if min(addrs) < 0:
                    continue
                worst = max(worst, warp_degree(addrs, site.width))
    return worst or None


def threads_of(src: str) -> int:
    """Threads per block from ``__launch_bounds__(N[, M])`` in the source (128 when absent)."""
    m = re.search(r"__launch_bounds__\((\d+)", src)
    return int(m.group(1)) if m else 128


def buffer_degrees(src: str, buffer: str) -> list[tuple[Site, int | None]]:
    """(site, worst degree: ``site_degree``) for every per-lane access of ``buffer``."""
    threads = threads_of(src)
    return [(s, site_degree(s, threads)) for s in access_sites(src, buffer)]


def shared_buffers(src: str) -> list[str]:
    """Names of the shared buffers in generated CUDA ``src``: the pointers TileLang carves out of the dynamic shared
    memory (``void* NAME = ((void*)((char*)buf_dyn_shmem + OFFSET));``) and static ``__shared__`` arrays."""
    names = re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem", src)
    names += re.findall(r"__shared__ (?:__align__\(\d+\) )?[\w ]+? (\w+)\[", src)
    return [n for n in dict.fromkeys(names) if n not in ("buf_dyn_shmem",)]


def worst_degrees(src: str, buffers: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """{buffer: (worst degree over its evaluated per-lane accesses, number of such accesses)} for ``buffers`` (all of
    ``shared_buffers(src)`` by default); a buffer with no evaluated access has degree 0."""
    out = {}
    for b in buffers if buffers is not None else shared_buffers(src):
        ds = [d for _, d in buffer_degrees(src, b) if d is not None]
        out[b] = (max(ds, default=0), len(ds))
    return out


def _configs(pattern: str):
    """The compile-test configurations (``kernels.build.all_configs``) whose name contains ``pattern``."""
    from kernels.build import all_configs
    return [c for c in all_configs() if pattern in c.name]


def report(src: str, title: str) -> str:
    """One line per shared buffer with per-lane accesses: worst degree, number of sites, and the sites worse than
    conflict-free (line: width B, ld/st, degree)."""
    lines = [f"== {title} ({threads_of(src)} threads)"]
    for b in shared_buffers(src):
        sites = buffer_degrees(src, b)
        if not sites:
            continue
        ds = [d for _, d in sites if d is not None]
        bad = [f"L{s.line}:{s.width}B {'st' if s.store else 'ld'} {d}-way" for s, d in sites if d and d > 1]
        unk = sum(d is None for _, d in sites)
        lines.append(f"  {b:16s} worst {max(ds, default=0):2d}  sites {len(sites):3d}"
                     + (f"  not evaluated {unk}" if unk else "") + (f"  {', '.join(bad)}" if bad else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m kernels.common.bank_conflicts PATTERN`` (compiles, or takes from TileLang's cache, every
    compile-test configuration whose name contains PATTERN, for sm_90a, no GPU needed) or ``--source FILE.cu``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kernels.common.bank_conflicts", description=main.__doc__)
    ap.add_argument("pattern", nargs="?", default=None, help="part of a kernel configuration's name, e.g. bwd_dqk")
    ap.add_argument("--source", default=None, help="a generated CUDA file instead")
    args = ap.parse_args(argv)
    if args.source:
        with open(args.source) as f:
            print(report(f.read(), args.source))
        return 0
    if not args.pattern:
        ap.error("give a configuration name pattern or --source FILE")
    cfgs = _configs(args.pattern)
    if not cfgs:
        print(f"no compile-test configuration matches {args.pattern!r}")
        return 2
    from kernels.build import get_kernel
    for c in cfgs:
        print(report(get_kernel(c).get_kernel_source(), c.name), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
