"""Per-run resets: process-global state that one run leaves behind in a warm worker of the process world.

A warm worker serves one run after another, so anything a run changes in module globals (a library's
cached process groups, its communication backend, an init context left open), in the environment or in
torch's global switches would reach the next run, which a fresh process would not see. Before every run the
process world calls each registered reset in each of its workers, in registration order, after the run's
groups of the previous run are gone and before the run's own setup.

A reset is a function without arguments, named by import reference (``"package.module:function"``) so that
a worker can find it. It must

- cost next to nothing when its library was never imported in the worker (look in ``sys.modules``; never
  import the library from a reset: importing DeepSpeed takes seconds);
- put the state back to what a fresh process has, or raise: the run then fails with the reset's name and
  traceback, and the worker is replaced.

Register one

- in a package's metadata, under the entry-point group ``dstest.resets`` (dstest registers its own
  DeepSpeed reset this way)::

      [project.entry-points."dstest.resets"]
      parallel_state = "mypkg.testing:reset_parallel_state"

- or at run time in the parent process, before the runs that need it (a conftest, a plugin)::

      import dstest.resets
      dstest.resets.register("mypkg.testing:reset_parallel_state")

dstest's own reset, :func:`restore_process_basics`, always runs first: the environment variables and the
working directory the worker started with, torch's default dtype, its deterministic-algorithms switch and
grad mode.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from dstest.errors import DstestError, InvalidArgument

__all__ = ["ENTRY_POINT_GROUP", "ResetFailed", "register", "registered", "restore_process_basics", "unregister"]

#: The entry-point group that packages list their resets under.
ENTRY_POINT_GROUP = "dstest.resets"

_BUILTIN = "dstest.resets:restore_process_basics"
_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_lock = threading.Lock()
_runtime: list[str] = []
_from_entry_points: tuple[str, ...] | None = None


class ResetFailed(DstestError, RuntimeError):
    """A registered reset could not be found or raised in a worker; the message names it."""


def _check_ref(ref: object) -> str:
    if not isinstance(ref, str) or not _REF.match(ref):
        raise InvalidArgument(
            f"reset {ref!r}: give an import reference 'package.module:function' (a worker process imports it "
            "by that name), e.g. 'mypkg.testing:reset_parallel_state'"
        )
    return ref


def register(ref: str) -> None:
    """Run the function ``ref`` ("package.module:function") in every worker before every later run.

    Registering the same reference twice is one registration."""
    ref = _check_ref(ref)
    with _lock:
        if ref not in _runtime:
            _runtime.append(ref)


def unregister(ref: str) -> None:
    """Undo :func:`register` (entry-point resets stay); a reference never registered is an error."""
    with _lock:
        if ref not in _runtime:
            raise InvalidArgument(f"reset {ref!r} is not registered at run time; registered: {_runtime}")
        _runtime.remove(ref)


def registered() -> tuple[str, ...]:
    """Every reset a run's workers call, in order: dstest's own, the entry points', then :func:`register`'s."""
    global _from_entry_points
    if _from_entry_points is None:
        from importlib.metadata import entry_points

        found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
        _from_entry_points = tuple(ep.value.strip() for ep in found)
    with _lock:
        refs = [_BUILTIN, *_from_entry_points, *_runtime]
    return tuple(dict.fromkeys(refs))


# ------------------------------------------------------------------------------------------------------
# In the worker
# ------------------------------------------------------------------------------------------------------

_resolved: dict[str, Callable[[], Any]] = {}
_baseline: dict[str, Any] = {}


def apply(refs: Iterable[str]) -> None:
    """Call each reset of ``refs`` (in a worker, before a run); raises :class:`ResetFailed` naming the one
    that failed."""
    for ref in refs:
        fn = _resolved.get(ref)
        if fn is None:
            module_name, _, attr = ref.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:
                raise ResetFailed(
                    f"reset {ref!r} cannot be found in the worker ({type(exc).__name__}: {exc}); register an "
                    "importable 'package.module:function'"
                ) from exc
            if not callable(obj):
                raise ResetFailed(f"reset {ref!r} is {type(obj).__name__}, not a function")
            fn = _resolved[ref] = obj
        try:
            fn()
        except Exception as exc:
            raise ResetFailed(
                f"reset {ref!r} failed before the run ({type(exc).__name__}: {exc}); the worker is replaced"
            ) from exc


def restore_process_basics() -> None:
    """The worker's starting environment variables and working directory; torch's default dtype,
    deterministic-algorithms switch and grad mode as a fresh process has them."""
    if not _baseline:  # the first run of this worker: what it started with
        _baseline["environ"] = dict(os.environ)
        _baseline["cwd"] = os.getcwd()
    environ: dict[str, str] = _baseline["environ"]
    if os.environ != environ:
        for name in [n for n in os.environ if n not in environ]:
            del os.environ[name]
        os.environ.update(environ)
    if os.getcwd() != _baseline["cwd"]:
        os.chdir(_baseline["cwd"])
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.get_default_dtype() is not torch.float32:
            torch.set_default_dtype(torch.float32)
        if torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(False)
        torch.set_grad_enabled(True)
