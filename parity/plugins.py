"""Backends that other distributions register under the entry-point group ``gdn_parity.backends``.

A distribution declares, in its pyproject.toml::

    [project.entry-points."gdn_parity.backends"]
    my-gdn = "my_gdn.parity_backend:MyGDN"

The entry point's name is the backend's registry name and must equal the class's ``name``. Loading never
raises: an entry point that cannot be loaded (import error, not a Backend subclass, a name taken, an
``available()`` that raises) becomes an ``unavailable`` backend of that name whose reason names the distribution
and the entry point, so it shows in ``parity list`` and in a run's tables and costs nothing else.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from parity.backends.base import Backend

GROUP = "gdn_parity.backends"


class UnloadableBackend(Backend):
    """Stands in for an entry point that could not be loaded: never available; ``reason`` says why."""

    reason: str = ""

    def available(self) -> tuple[bool, str]:
        return False, self.reason


def describe(ep: importlib.metadata.EntryPoint) -> str:
    """How messages name an entry point: entry point 'NAME' = 'VALUE' (group ...) of distribution DIST VERSION."""
    dist = getattr(ep, "dist", None)
    owner = f"distribution {dist.name} {dist.version}" if dist is not None else "an unknown distribution"
    return f"entry point {ep.name!r} = {ep.value!r} (group {GROUP}) of {owner}"


def _unloadable(name: str, reason: str) -> type[Backend]:
    """A subclass of UnloadableBackend for ``name``, reachable as ``parity.plugins:<its __qualname__>`` so that
    worker processes resolving backends by ``module:Class`` get the same stand-in."""
    ident = "Unloadable_" + re.sub(r"\W", "_", name)
    return type(ident, (UnloadableBackend,), {"name": name, "reason": reason, "__module__": __name__,
                                              "__qualname__": ident,
                                              "description": "entry point that could not be loaded"})


def load_entry_point(ep: importlib.metadata.EntryPoint, taken: Collection[str]) -> type[Backend]:
    """The Backend subclass ``ep`` names; raises ValueError (naming the entry point) when it cannot be loaded,
    is not a Backend subclass, has another ``name``, takes a name in ``taken``, or its ``available()`` raises."""
    where = describe(ep)
    if ep.name in taken:
        raise ValueError(f"{where}: the backend name {ep.name!r} is already registered; rename the entry point")
    try:
        cls = ep.load()
    except Exception as err:  # noqa: BLE001 - any failure of third-party code costs only this entry point
        raise ValueError(f"{where} cannot be loaded: {type(err).__name__}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ValueError(f"{where} is {cls!r}, not a parity.backends.base.Backend subclass")
    if cls.name != ep.name:
        raise ValueError(f"{where}: the class's name is {cls.name!r}; it must equal the entry point's name")
    try:
        cls().available()
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{where}: {cls.__name__}().available() raised {type(err).__name__}: {err}") from None
    return cls


@dataclass(frozen=True)
class Plugins:
    """backends: name -> class (an UnloadableBackend subclass where loading failed); problems: one message per
    entry point that failed, including those whose name was taken and so have no backend."""

    backends: dict[str, type[Backend]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()


def load_plugins(eps: Iterable[importlib.metadata.EntryPoint], reserved: Collection[str]) -> Plugins:
    """Every entry point's backend by name; those that cannot be loaded become UnloadableBackend subclasses
    (the first entry point of a name wins; ``reserved`` names, the built-in backends, are never replaced)."""
    found: dict[str, type[Backend]] = {}
    problems = []
    for ep in eps:
        try:
            found[ep.name] = load_entry_point(ep, set(reserved) | set(found))
        except ValueError as err:
            problems.append(str(err))
            if ep.name not in reserved and ep.name not in found:
                found[ep.name] = _unloadable(ep.name, str(err))
    return Plugins(found, tuple(problems))


@functools.cache
def installed_plugins(reserved: tuple[str, ...]) -> Plugins:
    """load_plugins over the installed distributions' entry points (once per process)."""
    plugins = load_plugins(importlib.metadata.entry_points(group=GROUP), reserved)
    _LOADED.append(plugins)
    return plugins


_LOADED: list[Plugins] = []  # what installed_plugins loaded in this process


def __getattr__(attr: str):
    """``parity.plugins:Unloadable_<name>``: the stand-in of that entry point, once this process has loaded the
    entry points (parity.backends.get_backend loads them before resolving such a spec)."""
    if attr.startswith("Unloadable_"):
        for plugins in _LOADED:
            for cls in plugins.backends.values():
                if cls.__qualname__ == attr:
                    return cls
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
