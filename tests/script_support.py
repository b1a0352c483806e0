"""The tests' loader of command-line scripts in folders that are no package (``scripts/`` by default)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).parent.parent / "scripts"


def load_script(name: str, folder: Path = SCRIPTS):
    """The module of ``folder/NAME.py``, executed once per call."""
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
