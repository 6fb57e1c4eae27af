"""Checking the checkers: the state watch of warm workers (contract F2: nothing a test leaves in a worker
reaches the next test), as properties.

The watch (:mod:`dstest.worlds.process.state_watch`) keeps a module's globals and the process's
``sys.path`` and environment, and after a run says what differs and puts it back. These properties drive
its functions directly, in this process, over random module states: attributes of random types (numbers,
strings, objects, ``None``, tuples, sets, and lists and dicts nested in each other, some shared between
names), perturbed by random edits (a name added, deleted, rebound to another object or to a fresh
container holding the same things; a container at any depth changed in place: an element appended,
removed, replaced, a key set or deleted, a member added or discarded; a change undone), and over random
edits of ``sys.path`` and ``os.environ``:

- the watch reports a leak exactly when the state differs from what was kept (containers compared by type
  and contents, everything else by identity), and names every name that differs and no other;
- after it, the state is exactly what was kept: the same object bound to every name, the same objects in
  every container, in the same order; a second look finds nothing;
- the unperturbed state reports nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstest.worlds.process.state_watch import ModuleStateWatch, restore_process_state, take_process_state

pytestmark = pytest.mark.cpu

_names = itertools.count()


class Thing:
    """A module-level object compared by identity."""


NAMES = st.sampled_from([f"v_{c}" for c in "abcdefghij"])
KEYS = st.one_of(st.integers(-3, 3), st.sampled_from(["k", "key", "x", "y"]))
LEAVES = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.builds(Thing),
    st.frozensets(st.integers(0, 5), max_size=3),
)


def _values() -> st.SearchStrategy[Any]:
    return st.recursive(
        LEAVES,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(KEYS, inner, max_size=4),
            st.tuples(inner, inner),
            st.sets(st.integers(0, 9), max_size=4),
        ),
        max_leaves=12,
    )


# -- a model of what the watch must see ----------------------------------------------------------------------


def _shape(value: Any, depth: int = 0) -> Any:
    """What a fresh process would see the same: containers by type and contents (a dict by its pairs, in
    any order), every other object by identity."""
    kind = type(value)
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(_shape(v, depth + 1) for v in value))
    if kind is dict:
        return ("dict", frozenset((k, _shape(v, depth + 1)) for k, v in value.items()))
    if kind is set:
        return ("set", frozenset(value))
    return ("object", id(value))


def _containers(value: Any, found: dict[int, tuple[Any, Any]]) -> None:
    """Every list, dict and set reachable from ``value``, with a shallow copy of what it holds now."""
    kind = type(value)
    if kind not in (list, dict, set, tuple) or id(value) in found:
        return
    found[id(value)] = (value, list(value.items()) if kind is dict else list(value))
    for inner in value.values() if kind is dict else value if kind is not set else ():
        _containers(inner, found)


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every container reachable from ``value`` with the path to it (a tuple, which cannot change, is
    passed through)."""
    found = [(here, value)] if type(value) in (list, dict, set) else []
    if type(value) in (list, tuple):
        for i, inner in enumerate(value):
            found += _paths(inner, (*here, i))
    elif type(value) is dict:
        for key, inner in value.items():
            found += _paths(inner, (*here, key))
    return found


# -- random edits ---------------------------------------------------------------------------------------------

EDITS = st.lists(
    st.tuples(
        st.sampled_from(["add", "delete", "rebind", "rebind_equal", "in_place", "undone"]),
        NAMES,
        st.integers(0, 1000),
        _values(),
    ),
    max_size=4,
)


def _edit_in_place(container: Any, pick: int, new: Any) -> None:
    kind = type(container)
    if kind is list:
        if container and pick % 3:
            if pick % 3 == 1:
                container.pop(pick % len(container))
            else:
                container[pick % len(container)] = new
        else:
            container.append(new)
    elif kind is dict:
        keys = list(container)
        if keys and pick % 3:
            if pick % 3 == 1:
                del container[keys[pick % len(keys)]]
            else:
                container[keys[pick % len(keys)]] = new
        else:
            container[f"new_{pick}"] = new
    else:  # a set
        members = sorted(container)
        if members and pick % 2:
            container.discard(members[pick % len(members)])
        else:
            container.add(100 + pick)


def _apply(module: types.ModuleType, edits: list[tuple[str, str, int, Any]]) -> None:
    namespace = vars(module)
    for kind, name, pick, new in edits:
        if kind == "add":
            namespace[f"{name}_added"] = new
        elif kind == "delete":
            namespace.pop(name, None)
        elif kind == "rebind" and name in namespace:
            namespace[name] = Thing() if pick % 2 else new
        elif kind == "rebind_equal" and name in namespace:
            value = namespace[name]
            if type(value) in (list, dict, set):
                namespace[name] = type(value)(value)  # a fresh container holding the same objects
        elif kind in ("in_place", "undone") and name in namespace:
            paths = _paths(namespace[name])
            if paths:
                _, container = paths[pick % len(paths)]
                if kind == "in_place":
                    _edit_in_place(container, pick, new)
                elif type(container) is list:
                    container.append(new)
                    container.pop()
                elif type(container) is dict:
                    container["undone"] = new
                    del container["undone"]


@contextlib.contextmanager
def _watched_module(bindings: dict[str, Any]) -> Iterator[types.ModuleType]:
    """A module of its own in sys.modules, holding ``bindings``."""
    name = f"dstest_prop_watched_{next(_names)}"
    module = types.ModuleType(name)
    vars(module).update(bindings)
    sys.modules[name] = module
    try:
        yield module
    finally:
        del sys.modules[name]


@given(bindings=st.dictionaries(NAMES, _values(), max_size=8), shared=st.booleans(), edits=EDITS)
def test_module_globals_a_leak_is_reported_iff_they_differ_each_name_named_and_all_put_back(
    bindings: dict[str, Any], shared: bool, edits: list[tuple[str, str, int, Any]]
) -> None:
    if shared and len(bindings) >= 2:  # two names holding the same container, somewhere inside
        first, second = sorted(bindings)[:2]
        bindings[second] = [bindings[first], bindings[second]]
    with _watched_module(bindings) as module:
        watch = ModuleStateWatch((module.__name__,))
        kept = dict(vars(module))
        shapes = {name: _shape(value) for name, value in kept.items() if name.startswith("v_")}
        containers: dict[int, tuple[Any, Any]] = {}
        for value in kept.values():
            _containers(value, containers)

        _apply(module, edits)
        now = {name: _shape(value) for name, value in vars(module).items() if name.startswith("v_")}
        differ = {name for name in shapes.keys() | now.keys() if shapes.get(name) != now.get(name)}

        found, unusable = watch.check_and_restore()
        assert unusable is None
        named = {line.split(":")[0].removeprefix(f"{module.__name__}.") for line in found}
        assert named == differ, (found, edits)
        assert all(line.startswith(f"{module.__name__}.") for line in found)
        # put back exactly: the same objects bound, the same objects in every container, in order
        assert vars(module).keys() == kept.keys() and all(vars(module)[n] is v for n, v in kept.items())
        for container, before in containers.values():
            after = list(container.items()) if type(container) is dict else list(container)
            if type(container) is set:
                assert container == set(before)
            else:
                assert len(after) == len(before) and all(
                    (a[0] == b[0] and a[1] is b[1]) if type(container) is dict else a is b
                    for a, b in zip(after, before, strict=True)
                )
        assert watch.check_and_restore() == ([], None)


PATH_ENTRIES = st.sampled_from([f"/dstest-prop/{c}" for c in "abcdef"])
ENV_NAMES = st.sampled_from([f"DSTEST_PROP_{c}" for c in "ABCDEF"])
PROCESS_EDITS = st.lists(
    st.one_of(
        st.tuples(st.just("path_insert"), PATH_ENTRIES, st.integers(0, 50)),
        st.tuples(st.just("path_remove"), PATH_ENTRIES, st.integers(0, 50)),
        st.tuples(st.just("path_swap"), st.integers(0, 50), st.integers(0, 50)),
        st.tuples(st.just("path_rebind_equal"), st.none(), st.none()),
        st.tuples(st.just("env_set"), ENV_NAMES, st.text("xyz", max_size=3)),
        st.tuples(st.just("env_unset"), ENV_NAMES, st.none()),
    ),
    max_size=5,
)


def _apply_process(edits: list[tuple[str, Any, Any]]) -> None:
    for kind, what, how in edits:
        if kind == "path_insert":
            sys.path.insert(how % (len(sys.path) + 1), what)
        elif kind == "path_remove" and what in sys.path:
            sys.path.remove(what)
        elif kind == "path_swap":
            i, j = what % len(sys.path), how % len(sys.path)
            sys.path[i], sys.path[j] = sys.path[j], sys.path[i]
        elif kind == "path_rebind_equal":
            sys.path = list(sys.path)
        elif kind == "env_set":
            os.environ[what] = how
        elif kind == "env_unset":
            os.environ.pop(what, None)


@given(
    path=st.lists(PATH_ENTRIES, max_size=4, unique=True),
    env=st.dictionaries(ENV_NAMES, st.text("xyz", max_size=3), max_size=4),
    edits=PROCESS_EDITS,
)
def test_sys_path_and_environment_a_leak_is_reported_iff_they_differ_each_named_and_all_put_back(
    path: list[str], env: dict[str, str], edits: list[tuple[str, Any, Any]]
) -> None:
    own_path, own_env = sys.path, dict(os.environ)
    try:
        sys.path = [*path, *own_path]
        os.environ.update(env)
        the_list, path_before, env_before = sys.path, list(sys.path), dict(os.environ)
        saved = take_process_state()

        _apply_process(edits)
        added = [p for p in dict.fromkeys(sys.path) if p not in path_before]
        removed = [p for p in dict.fromkeys(path_before) if p not in sys.path]
        reordered = not added and not removed and sys.path != path_before
        env_differ = {n for n in env_before.keys() | os.environ.keys() if env_before.get(n) != os.environ.get(n)}

        found, unusable = restore_process_state(saved)
        assert unusable is None
        assert bool(found) == bool(added or removed or reordered or env_differ), (found, edits)
        assert {line.split("'")[1] for line in found if line.startswith("os.environ")} == env_differ
        path_lines = [line for line in found if line.startswith("sys.path")]
        assert [p for p in added if not any(repr(p) in line for line in path_lines)] == []
        assert [p for p in removed if not any(repr(p) in line for line in path_lines)] == []
        assert reordered == (path_lines == ["sys.path: its entries reordered or repeated by the run; put back"])
        assert set(found) == set(path_lines) | {line for line in found if line.startswith("os.environ")}
        # put back exactly, the same list object
        assert sys.path is the_list and sys.path == path_before and dict(os.environ) == env_before
        assert restore_process_state(saved) == ([], None)
    finally:
        sys.path = own_path
        for name in [n for n in os.environ if n not in own_env]:
            del os.environ[name]
        os.environ.update(own_env)
