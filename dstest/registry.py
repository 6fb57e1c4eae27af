"""The names of targets and worlds, built in and from plug-ins: one torch-free registry.

dstest ships two targets (``impl``, ``deepspeed``) and six worlds (``threaded``, ``threaded-cuda``,
``fake``, ``process``, ``nccl``, ``launched``). Third parties add more in any of three ways, all ending here:

* a pytest plugin or ``conftest.py`` implements the hooks of :mod:`dstest.pytest.hookspecs`
  (``pytest_dstest_targets()`` / ``pytest_dstest_worlds()`` return ``{name: factory}``); the dstest plugin registers
  what they return at ``pytest_configure``;
* a distribution declares an entry point in the group ``dstest.targets`` or ``dstest.worlds``
  (``mytarget = "mypkg.adapter:MyTarget"``), loaded on the first lookup, in every process (the process
  world's workers included);
* code calls :func:`register_target` / :func:`register_world` directly.

A *factory* is a callable with no required arguments that returns the adapter (a
:class:`dstest.targets.Target`) or the world (a :class:`dstest.worlds.World`), usually the class itself.
Built-in entries are ``(module, attribute, keyword arguments)`` triples, imported on first use, so that
listing or checking names never imports torch (the pytest plugin checks ``--dstest-target`` at configure
time). A plug-in cannot take a built-in name: that would silently change what ``impl`` means.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dstest.errors import InvalidArgument

__all__ = [
    "BUILTIN_TARGETS",
    "BUILTIN_WORLDS",
    "BUILTIN_WORLD_MARKERS",
    "TARGET_ENTRY_POINTS",
    "WORLD_ENTRY_POINTS",
    "check_target",
    "check_world_name",
    "is_entry_point_target",
    "register_target",
    "register_world",
    "target_factory",
    "target_names",
    "world_factory",
    "world_marker",
    "world_names",
]

#: Entry-point groups a distribution declares its targets and worlds in.
TARGET_ENTRY_POINTS = "dstest.targets"
WORLD_ENTRY_POINTS = "dstest.worlds"

#: name -> (module, attribute, keyword arguments): the targets dstest ships.
BUILTIN_TARGETS: Mapping[str, tuple[str, str, Mapping[str, Any]]] = {
    "impl": ("dstest.targets.impl", "ImplTarget", {}),
    "deepspeed": ("dstest.targets.deepspeed", "DeepSpeedTarget", {}),
}
#: name -> (module, attribute, keyword arguments): the worlds dstest ships.
BUILTIN_WORLDS: Mapping[str, tuple[str, str, Mapping[str, Any]]] = {
    "threaded": ("dstest.worlds.threaded", "ThreadedWorld", {"warm": True}),
    "threaded-cuda": ("dstest.worlds.threaded", "ThreadedWorld", {"device": "cuda", "warm": True}),
    "fake": ("dstest.worlds.fake", "FakeWorld", {}),
    "process": ("dstest.worlds.process", "ProcessWorld", {}),
    "nccl": ("dstest.worlds.nccl", "NcclWorld", {}),
    "launched": ("dstest.worlds.launched", "LaunchedWorld", {}),
}
#: The pytest marker of each built-in world's items (known without importing torch). ``launched`` is not
#: listed: its marker follows its backend (gpu on NCCL, cpu on gloo), asked of the world on first use.
BUILTIN_WORLD_MARKERS: Mapping[str, str] = {
    "threaded": "cpu",
    "threaded-cuda": "gpu",
    "fake": "cpu",
    "process": "cpu",
    "nccl": "gpu",
}

Factory = Callable[[], Any]


@dataclass
class _Kind:
    """The registry of one kind (targets or worlds)."""

    kind: str
    group: str
    builtin: Mapping[str, tuple[str, str, Mapping[str, Any]]]
    plugins: dict[str, Factory] = field(default_factory=dict)
    loaded_entry_points: bool = False
    entry_point_names: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, name: object, factory: object, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name or name != name.strip() or "," in name:
            raise InvalidArgument(
                f"{self.kind} name {name!r}: give a non-empty str without commas or surrounding spaces "
                f"(e.g. 'my{self.kind}')"
            )
        if name in self.builtin:
            raise InvalidArgument(
                f"{self.kind} name {name!r} is built into dstest ({', '.join(self.builtin)}); "
                "register a plug-in under another name"
            )
        if not callable(factory):
            raise InvalidArgument(
                f"{self.kind} {name!r}: factory={factory!r} ({type(factory).__name__}) is not callable; give a "
                f"class or function that returns the {self.kind} when called without arguments"
            )
        with self.lock:
            known = self.plugins.get(name)
            if known is not None and known is not factory and not replace:
                raise InvalidArgument(
                    f"{self.kind} {name!r} is registered twice, by {_label(known)} and {_label(factory)}; "
                    "give one of them another name"
                )
            self.plugins[name] = factory
            self.entry_point_names.discard(name)

    def load_entry_points(self) -> None:
        if self.loaded_entry_points:
            return
        from importlib.metadata import entry_points

        found = list(entry_points(group=self.group))
        with self.lock:
            self.loaded_entry_points = True
        for ep in found:
            if ep.name in self.builtin or ep.name in self.plugins:
                continue  # a plug-in registered by hand (or a conftest) wins over its own entry point
            self.register(ep.name, _LazyEntryPoint(ep.name, ep.value, ep.load))
            self.entry_point_names.add(ep.name)

    def names(self) -> tuple[str, ...]:
        self.load_entry_points()
        return (*self.builtin, *sorted(self.plugins))

    def factory(self, name: object) -> Factory:
        if isinstance(name, str) and name in self.builtin:
            module, attr, kwargs = self.builtin[name]
            cls: Factory = getattr(importlib.import_module(module), attr)
            return functools.partial(cls, **kwargs) if kwargs else cls
        self.load_entry_points()
        found = self.plugins.get(name) if isinstance(name, str) else None
        if found is None:
            raise InvalidArgument(f"{self.kind}={name!r} is unknown; allowed: {list(self.names())}")
        if isinstance(found, _LazyEntryPoint):
            loaded: Factory = found.load()
            if not callable(loaded):
                raise InvalidArgument(
                    f"{self.kind} {name!r}: entry point {found.value!r} in group {self.group!r} loads "
                    f"{loaded!r}, which is not callable; point it at the {self.kind}'s class or factory"
                )
            with self.lock:
                self.plugins[str(name)] = loaded
            return loaded
        return found


class _LazyEntryPoint:
    """An entry point's object, imported on first call (listing names imports nothing)."""

    def __init__(self, name: str, value: str, load: Callable[[], Any]) -> None:
        self.name, self.value, self._load = name, value, load

    def load(self) -> Any:
        """The object the entry point names (its module imported now)."""
        return self._load()

    def __call__(self) -> Any:
        return self._load()()

    def __repr__(self) -> str:
        return f"<entry point {self.name} = {self.value}>"


def _label(factory: object) -> str:
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(factory)


_TARGETS = _Kind("target", TARGET_ENTRY_POINTS, BUILTIN_TARGETS)
_WORLDS = _Kind("world", WORLD_ENTRY_POINTS, BUILTIN_WORLDS)
#: Markers of plug-in worlds, learnt from the world itself on first use.
_PLUGIN_MARKERS: dict[str, str] = {}


def register_target(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``factory()`` the adapter of target ``name`` (``--dstest-target=name``, ``dstest --target name``).

    Registering the same factory twice is harmless; another factory under a taken name raises
    :class:`~dstest.errors.InvalidArgument` unless ``replace=True``.
    """
    _TARGETS.register(name, factory, replace=replace)


def register_world(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``factory()`` the world ``name`` (``--dstest-worlds=name``, ``@dstest.spec(worlds=[name])``)."""
    _WORLDS.register(name, factory, replace=replace)
    _PLUGIN_MARKERS.pop(name, None)


def target_names() -> tuple[str, ...]:
    """Every target name: the built-in ones first, then plug-ins in name order."""
    return _TARGETS.names()


def world_names() -> tuple[str, ...]:
    """Every world name: the built-in ones first, then plug-ins in name order."""
    return _WORLDS.names()


def target_factory(name: object) -> Factory:
    """The factory of target ``name``; :class:`~dstest.errors.InvalidArgument` naming the known ones if none."""
    return _TARGETS.factory(name)


def world_factory(name: object) -> Factory:
    """The factory of world ``name``; :class:`~dstest.errors.InvalidArgument` naming the known ones if none."""
    return _WORLDS.factory(name)


def is_entry_point_target(name: str) -> bool:
    """Whether target ``name`` comes from an entry point (which every process finds by itself)."""
    _TARGETS.load_entry_points()
    return name in _TARGETS.entry_point_names


def world_marker(name: str) -> str:
    """'cpu' or 'gpu': the pytest marker of world ``name``'s items (a plug-in world's own ``marker``)."""
    builtin = BUILTIN_WORLD_MARKERS.get(name)  # ``launched`` goes on: its world knows its marker
    if builtin is not None:
        return builtin
    marker = _PLUGIN_MARKERS.get(name)
    if marker is None:
        marker = str(getattr(world_factory(name)(), "marker", "cpu"))
        if marker not in ("cpu", "gpu"):
            raise InvalidArgument(f"world {name!r}: marker={marker!r}; a world's marker must be 'cpu' or 'gpu'")
        _PLUGIN_MARKERS[name] = marker
    return marker


def check_target(value: object, name: str = "target") -> str:
    """``value`` if it names a known system under test: built in or a registered plug-in (imports no target)."""
    names = target_names()
    if not isinstance(value, str) or value not in names:
        raise InvalidArgument(f"{name}={value!r}: unknown target; allowed: {', '.join(names)}")
    return value


def check_world_name(value: object, name: str = "world") -> str:
    """``value`` if it names a known world: built in or a registered plug-in (imports no world)."""
    names = world_names()
    if not isinstance(value, str) or value not in names:
        raise InvalidArgument(f"{name}={value!r}: unknown world; allowed: {', '.join(names)}")
    return value
