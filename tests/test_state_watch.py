"""The module-state watch of warm workers (:mod:`dstest.worlds.process.state_watch`), in this process: what
it reports and puts back after a run (contract F2: nothing a test leaves in a worker reaches the next
test), and that watching is silent when nothing changed. The end-to-end checks through the process world
are in test_process_world.py and test_compat_torch.py."""

from __future__ import annotations

import gc
import os
import sys
import types
import warnings

import pytest
import torch

from dstest.worlds.process.state_watch import ModuleStateWatch

pytestmark = pytest.mark.cpu


class _Key:
    """A dict key that hashes in Python, as torch's operator overloads do: counts its hash calls."""

    hashed = 0

    def __hash__(self) -> int:
        _Key.hashed += 1
        return id(self) >> 4


class _WarnsOnClass:
    """A module-level object that warns when its attributes are read (``torch.distributed.reduce_op``)."""

    def __getattribute__(self, name: str) -> object:
        warnings.warn("reduce_op is deprecated", FutureWarning, stacklevel=2)
        return object.__getattribute__(self, name)


@pytest.fixture
def module(request: pytest.FixtureRequest):
    name = f"dstest_watched_{request.node.name}"
    mod = types.ModuleType(name)
    mod.SETTING = "fresh"
    mod.ITEMS = [1, 2]
    mod.TABLE = {_Key(): i for i in range(50)}
    mod.NAMES = {"a", "b"}
    mod.deprecated = _WarnsOnClass()
    mod.sub = types.ModuleType(f"{name}.sub")
    sys.modules[name] = mod
    yield mod
    del sys.modules[name]


def test_nothing_changed_reports_nothing_hashes_no_key_and_reads_no_attribute(module) -> None:
    watch = ModuleStateWatch((module.__name__,))
    before = _Key.hashed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated object's warning would raise here
        for _ in range(3):
            assert watch.check_and_restore() == ([], None)
    assert _Key.hashed == before  # the table was compared by identity, in order


def test_each_change_is_put_back_and_named(module) -> None:
    watch = ModuleStateWatch((module.__name__,))
    items, table = module.ITEMS, module.TABLE
    first_key = next(iter(table))
    module.SETTING = "left by a test"
    module.ITEMS.append(3)
    table[first_key] = -1
    module.NAMES.add("c")
    module.ADDED = 1
    del module.deprecated
    found, unusable = watch.check_and_restore()
    n = module.__name__
    assert unusable is None
    assert sorted(found) == sorted(
        [
            f"{n}.SETTING: rebound to a str; put back",
            f"{n}.ITEMS: its list changed in place; contents put back",
            f"{n}.TABLE: its dict changed in place; contents put back",
            f"{n}.NAMES: its set changed in place; contents put back",
            f"{n}.ADDED: added by the run (int); removed",
            f"{n}.deprecated: deleted; put back",
        ]
    )
    assert module.SETTING == "fresh" and module.ITEMS is items and items == [1, 2]
    assert module.TABLE is table and table[first_key] == 0 and module.NAMES == {"a", "b"}
    assert not hasattr(module, "ADDED") and isinstance(object.__getattribute__(module.deprecated, "__class__"), type)
    assert watch.check_and_restore() == ([], None)


def test_same_contents_in_another_order_or_a_fresh_equal_container_is_not_a_change(module) -> None:
    watch = ModuleStateWatch((module.__name__,))
    key = next(iter(module.TABLE))
    module.TABLE[key] = module.TABLE.pop(key)  # the same pairs, the first one now last
    module.ITEMS = [1, 2]  # what a reset makes: a new list with the same members
    assert watch.check_and_restore() == ([], None)


def test_a_module_imported_after_watching_began_is_watched_from_then_on(module) -> None:
    watch = ModuleStateWatch((module.__name__,))
    late = types.ModuleType(f"{module.__name__}.late")
    late.VALUE = 1
    sys.modules[late.__name__] = late
    try:
        assert watch.check_and_restore() == ([], None)  # first seen here: saved as it is now
        late.VALUE = 2
        assert watch.check_and_restore()[0] == [f"{late.__name__}.VALUE: rebound to a int; put back"]
        assert late.VALUE == 1
    finally:
        del sys.modules[late.__name__]


def test_what_torch_compile_adds_to_a_modules_globals_is_left_in_place(module) -> None:
    """dynamo puts the compiled graph in the globals of the compiled function's module and its cached code
    looks it up there: removed, the function's next call fails with ``NameError: __compiled_fn_...``
    (DeepSpeed's MoE gating, compiled by ``jit_script_compat``)."""
    watch = ModuleStateWatch((module.__name__,))
    compiled = {"__compiled_fn_1_0a1b": object(), "__resume_at_30_2": object(), "__import_torch_dot_nn": torch.nn}
    vars(module).update(compiled)
    for _ in range(2):
        assert watch.check_and_restore() == ([], None)
        assert all(vars(module)[name] is value for name, value in compiled.items())
    module.SETTING = "still watched"
    assert watch.check_and_restore()[0] == [f"{module.__name__}.SETTING: rebound to a str; put back"]


def _call_compiled(ctx) -> float:
    return float(_double(torch.tensor([ctx.rank + 1.0])).item())


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


_double = torch.compile(_double, backend="eager")  # dynamo installs its graph in this module's globals


def test_a_function_compiled_in_a_watched_module_runs_again_on_the_warm_workers() -> None:
    """End to end on the process world, this module watched: each run calls the compiled function."""
    from dstest.worlds.process import ProcessWorld
    from dstest.worlds.request import RunRequest

    for _ in range(3):
        assert ProcessWorld().run(RunRequest(_call_compiled, 2, watch_modules=(__name__,), timeout=120)) == [2.0, 4.0]


# -- the scope of one test as a fresh process would run it (fresh_process: torch's test bases) --------------


@pytest.fixture
def user_code(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A test module of the user's that imports a helper of theirs, and modules a test imports later; their
    directory on sys.path. What the scopes kept of them is forgotten afterwards."""
    from dstest.worlds.process.state_watch import fresh_scope

    (tmp_path / "scoped_helper.py").write_text("ITEMS = []\n")
    (tmp_path / "scoped_tests.py").write_text("import scoped_helper\n\nSEEN = []\nTABLE = {'k': [1]}\n")
    (tmp_path / "scoped_late.py").write_text("VALUE = 1\n")
    (tmp_path / "scoped_ops.py").write_text(
        "import torch\n\nlib = torch.library.Library('dstest_scoped_ops', 'DEF')\nlib.define('twice(Tensor x) -> Tensor')\n"
        "\n\ndef twice(x):\n    return x * 2\n"  # a function: its module is in a reference cycle
    )
    (tmp_path / "scoped_pkg").mkdir()
    (tmp_path / "scoped_pkg" / "__init__.py").write_text("")
    (tmp_path / "scoped_pkg" / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("scoped_helper", "scoped_tests", "scoped_late", "scoped_pkg", "scoped_pkg.sub", "scoped_ops")
    yield tmp_path
    for name in names:
        sys.modules.pop(name, None)
        fresh_scope._AS_IMPORTED.pop(name, None)


def _import(name: str) -> types.ModuleType:
    import importlib

    return importlib.import_module(name)


def test_a_fresh_process_scope_puts_back_what_the_test_left_and_names_each_thing(user_code, monkeypatch) -> None:
    """Everything a fresh interpreter per test would not have kept: put back, named; a signal handler, which
    Python cannot be sure to put back, also has the worker replaced."""
    import signal

    from dstest.worlds.process.state_watch import fresh_process, take_pending

    take_pending()
    monkeypatch.setenv("DSTEST_SCOPE_SET", "before")  # monkeypatch puts it back even if the scope fails to
    cwd, dtype, threads, printed = (
        os.getcwd(),
        torch.get_default_dtype(),
        torch.get_num_threads(),
        str(torch.ones(1) / 3),
    )
    with fresh_process() as scope:
        tests = _import("scoped_tests")  # as the rank imports the test module, before it starts
        scope.started(tests)
        tests.SEEN.append(1)
        tests.TABLE["k"].append(2)
        tests.ADDED = True
        sys.modules["scoped_helper"].ITEMS.append(3)
        _import("scoped_late")
        _import("scoped_pkg.sub")
        _import("json.tool")  # a library: stays
        sys.path.insert(0, "/dstest-scope-left")
        os.environ["DSTEST_SCOPE_SET"] = "after"
        os.chdir(user_code)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(threads + 1)
        torch.set_printoptions(precision=2)
        own = os.sched_getaffinity(0)
        bound = {min(own)} if len(own) > 1 else own
        os.sched_setaffinity(0, bound)  # binding the rank to a core, as launchers' --bind options do
    found, unusable = take_pending()
    moved = [f"CPU affinity: {sorted(own)} -> {sorted(bound)} by the run; put back"] if bound != own else []
    assert sorted(found) == sorted(
        [
            *moved,
            "scoped_tests.SEEN: its list changed in place; contents put back",
            "scoped_tests.TABLE: a list inside it changed in place; contents put back",
            "scoped_tests.ADDED: added by the run (bool); removed",
            "scoped_helper.ITEMS: its list changed in place; contents put back",
            "sys.modules['scoped_late']: imported by the run; removed (a fresh process imports it anew)",
            "sys.modules['scoped_pkg'] (and 1 of its submodules): imported by the run; removed (a fresh process "
            "imports it anew)",
            "sys.path: '/dstest-scope-left' added by the run; removed",
            "os.environ['DSTEST_SCOPE_SET']: changed by the run; put back",
            f"working directory: changed by the run to {str(user_code)!r}; put back",
            "signal handler of SIGUSR2: set by the run; put back, and the worker is replaced",
            "torch default dtype: torch.float32 -> torch.float64 by the run; put back",
            f"torch num threads: {threads} -> {threads + 1} by the run; put back",
            "torch print options: {'precision': 4} -> {'precision': 2} by the run; put back",
        ]
    ), found
    assert unusable == "the run set the handler of SIGUSR2"
    assert tests.SEEN == [] and tests.TABLE == {"k": [1]} and not hasattr(tests, "ADDED")
    assert sys.modules["scoped_helper"].ITEMS == [] and "json.tool" in sys.modules
    assert "scoped_late" not in sys.modules and "scoped_pkg" not in sys.modules and "scoped_pkg.sub" not in sys.modules
    assert "/dstest-scope-left" not in sys.path and os.environ["DSTEST_SCOPE_SET"] == "before" and os.getcwd() == cwd
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert (torch.get_default_dtype(), torch.get_num_threads(), str(torch.ones(1) / 3)) == (dtype, threads, printed)
    assert os.sched_getaffinity(0) == own


def test_a_scope_with_nothing_changed_reports_nothing(user_code) -> None:
    from dstest.worlds.process.state_watch import fresh_process, take_pending

    take_pending()
    for _ in range(2):
        with fresh_process(quiet_env=lambda name: name == "DSTEST_QUIET") as scope:
            scope.started(_import("scoped_tests"))
            os.environ["DSTEST_QUIET"] = "set by the harness in every rank"
            torch.manual_seed(1)  # the RNG is a fresh process's at the start of each test, not compared
        assert take_pending() == ([], None) and "DSTEST_QUIET" not in os.environ


def test_a_held_scope_keeps_what_its_tests_leave_until_a_test_of_another_key(user_code) -> None:
    """torch's continuous bases: one process serves a class's tests, so the next test of the class sees what
    the last one left; the next class starts afresh, and what the class left is named then."""
    from dstest.worlds.process.state_watch import close_held_scope, fresh_process, take_pending

    take_pending()
    for expected in ([], [1]):
        with fresh_process(key="ClassA") as scope:
            tests = _import("scoped_tests")
            scope.started(tests)
            assert tests.SEEN == expected
            tests.SEEN.append(1)
        assert take_pending() == ([], None)
    with fresh_process(key="ClassB") as scope:
        scope.started(_import("scoped_tests"))
        assert tests.SEEN == []
    assert take_pending() == (["scoped_tests.SEEN: its list changed in place; contents put back"], None)
    close_held_scope()
    assert take_pending() == ([], None)


def test_a_module_of_the_users_that_a_test_imported_is_imported_anew_by_the_next(user_code) -> None:
    """As in a fresh process: also when it registers torch ops (a second ``Library(ns, "DEF")`` while the
    first is alive fails with "Only a single TORCH_LIBRARY can be used to register the namespace")."""
    from dstest.worlds.process.state_watch import fresh_process, take_pending

    take_pending()
    gc.disable()  # not left to when the collector happens to run: the function's globals are in a cycle
    try:
        for _ in range(2):
            with fresh_process() as scope:
                scope.started(_import("scoped_tests"))
                _import("scoped_ops")
            assert take_pending()[0] == [
                "sys.modules['scoped_ops']: imported by the run; removed (a fresh process imports it anew)"
            ]
    finally:
        gc.enable()
