"""The project's modules import one another without a cycle: every ``import`` of every module of the packages
(top level or inside a function: a lazy import is still a dependency), read with ``ast``, makes an edge to the
project module it names; the graph must be acyclic.  CPU only, imports nothing it reads."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kernels", "parity", "cases", "reference", "benchmarks", "scripts", "tests")


def project_modules() -> dict[str, str]:
    """{dotted module name: file path} of every .py file under ``PACKAGES``."""
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            if "__pycache__" in d:
                continue
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def imports_of(name: str, path: str, modules) -> set[str]:
    """The project modules ``name`` (at ``path``) imports: ``import a.b`` -> a.b; ``from a import b`` -> a.b when
    that is a module, else a; relative imports resolved against the module's package."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:       # ``import a.b.c`` of a name inside a module: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph():
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_lazy_imports_are_edges():
    g = _graph()
    assert "kernels.backward.configs" in g["kernels.plan"]            # top-level absolute import
    assert "kernels.backward.dqk" in g["kernels.backward.configs"]     # relative import inside a function


def test_no_import_cycle_among_the_project_modules():
    found = cycles(_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"
