"""The tests' loader of the command-line scripts in ``scripts/`` (a folder that is no package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).parent.parent / "scripts"


def load_script(name: str):
    """The module of ``scripts/NAME.py``, executed once per call."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
