"""Backends from the ``gdn_parity.backends`` entry-point group: loading, failures that cost only themselves, the
README's example backend (the file examples/byo-kernel holds) installed and run through ``python -m parity``."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from parity import plugins
from parity.backends import BACKENDS, get_backend, resolve
from parity.cli import main as cli_main
from parity.runner import backend_specs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "byo-kernel"
BACKEND_FILE = EXAMPLE / "my_gdn" / "parity_backend.py"

GOOD = '''from parity.backends.reference import TorchEmulated


class Good(TorchEmulated):
    name = "plug-good"


class Misnamed(TorchEmulated):
    name = "something-else"


class Raises(TorchEmulated):
    name = "plug-raises"

    def available(self):
        raise RuntimeError("no driver")


NOT_A_CLASS = 42
'''


def make_dist(site: Path, name: str, version: str, entry_points: dict[str, str], files: dict[str, str]) -> None:
    """A distribution as an installer leaves it: its modules and a ``*.dist-info`` with METADATA and
    entry_points.txt (group gdn_parity.backends)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{plugins.GROUP}]\n{eps}")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)


def _entry_points(site: Path):
    return [ep for d in importlib.metadata.distributions(path=[str(site)]) for ep in d.entry_points
            if ep.group == plugins.GROUP]


@pytest.fixture
def fresh_plugins():
    plugins.installed_plugins.cache_clear()
    yield
    plugins.installed_plugins.cache_clear()


def test_each_bad_entry_point_costs_only_itself_and_names_its_distribution(tmp_path, monkeypatch):
    make_dist(tmp_path, "plug-pkg", "1.2", {
        "plug-good": "plug_mod:Good", "plug-missing": "no_such_module_xyz:Thing", "plug-int": "plug_mod:NOT_A_CLASS",
        "plug-misnamed": "plug_mod:Misnamed", "plug-raises": "plug_mod:Raises", "ref-recurrent": "plug_mod:Good",
    }, {"plug_mod.py": GOOD})
    monkeypatch.syspath_prepend(str(tmp_path))
    found = plugins.load_plugins(_entry_points(tmp_path), reserved=tuple(BACKENDS))
    assert found.backends["plug-good"].__name__ == "Good"
    assert found.backends["plug-good"]().available()[0]
    assert "ref-recurrent" not in found.backends  # a built-in is never replaced
    expect = {"plug-missing": "ModuleNotFoundError", "plug-int": "not a parity.backends.base.Backend subclass",
              "plug-misnamed": "the class's name is 'something-else'",
              "plug-raises": "Raises().available() raised RuntimeError: no driver"}
    for name, why in expect.items():
        ok, reason = found.backends[name]().available()
        assert not ok and why in reason and "distribution plug-pkg 1.2" in reason and f"{name!r}" in reason, reason
    assert len(found.problems) == 5
    assert any("'ref-recurrent'" in p and "already registered" in p for p in found.problems)


def test_installed_entry_points_resolve_by_name_and_in_worker_processes(tmp_path, monkeypatch, fresh_plugins):
    make_dist(tmp_path, "plug-pkg", "1.2", {"plug-good": "plug_mod:Good", "plug-missing": "no_such_module_xyz:T"},
              {"plug_mod.py": GOOD})
    monkeypatch.syspath_prepend(str(tmp_path))
    chosen = resolve(None)  # every registered backend: the built-ins and the entry points
    names = [b.name for b in chosen]
    assert set(BACKENDS) <= set(names) and {"plug-good", "plug-missing"} <= set(names)
    # workers resolve backends again from ``module:Class``: the stand-in of a broken entry point survives that
    for b in chosen:
        if b.name.startswith("plug-"):
            again = get_backend(backend_specs([b])[0])
            assert again.name == b.name and again.available() == b.available()
    with pytest.raises(ValueError, match="plug-good"):  # the unknown-name message lists the entry points too
        get_backend("no-such-backend")


def test_parity_list_shows_installed_entry_points(tmp_path, monkeypatch, capsys, fresh_plugins):
    _install_example(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_main(["list"]) == 0
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["my-gdn"].split()[1] == "yes"
    assert rows["broken-gdn"].split()[1] == "no" and "distribution broken-gdn 0.0.1" in rows["broken-gdn"]
    assert "warning: entry point 'broken-gdn'" in err


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_shows_the_example_backend_and_its_entry_point_verbatim():
    readme = (ROOT / "README.md").read_text()
    assert BACKEND_FILE.read_text() in _code_blocks(readme, "python")
    table = '[project.entry-points."gdn_parity.backends"]\nmy-gdn = "my_gdn.parity_backend:MyGDN"\n'
    assert table in (EXAMPLE / "pyproject.toml").read_text()
    assert any(table in block for block in _code_blocks(readme, "toml"))


def _install_example(site: Path) -> None:
    """examples/byo-kernel as installed, entry points from its pyproject.toml; and a distribution whose entry
    point cannot be imported."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    files = {str(p.relative_to(EXAMPLE)): p.read_text() for p in (EXAMPLE / "my_gdn").glob("*.py")}
    make_dist(site, project["name"], project["version"], project["entry-points"][plugins.GROUP], files)
    make_dist(site, "broken-gdn", "0.0.1", {"broken-gdn": "broken_gdn_missing.backend:Kernel"}, {})


@pytest.mark.slow
def test_example_entry_point_backend_runs_through_parity_run(tmp_path):
    from parity import results
    from parity.verdicts import judge_frame

    site = tmp_path / "site"
    _install_example(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    out = tmp_path / "run" / "results.jsonl"
    cmd = [sys.executable, "-m", "parity", "run", "--matrix", "smoke", "--T", "64", "--limit", "4", "--backends",
           "my-gdn,broken-gdn", "--workers", "1", "--no-repeat", "--cache", "none", "--no-progress", "--no-report",
           "--out", str(out)]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    rs = results.load(out)
    assert rs.runs[0]["backends"] == ["torch-emulated", "my-gdn", "broken-gdn"]
    assert rs.runs[0]["versions"]["my-gdn"] == {"my-gdn": "0.1.0"}
    judged = judge_frame(rs.frame())
    mine = judged[judged["backend"] == "my-gdn"]
    assert len(mine) == 4 * 2 and set(mine["impl"]) == {"my_gdn/loop-fp32"}  # o and ht of every case
    assert set(mine["verdict"]) == {"PASS"}, mine[["case_id", "tensor", "verdict", "v_message"]].to_string()
    broken = judged[judged["backend"] == "broken-gdn"]
    assert len(broken) == 8 and set(broken["verdict"]) == {"SKIP"}
    assert all("distribution broken-gdn 0.0.1" in r and "ModuleNotFoundError" in r for r in broken["reason"])
