"""State a run leaves behind in a warm worker: found by comparison, put back, named.

A warm worker serves one run after another; a fresh process would start each of them as importing left
things. Hand-kept resets (:mod:`dstest.resets`) undo what is known to change, and say nothing; this module
catches what nobody listed, puts it back and names it. Two watches feed one report:

- :class:`ModuleStateWatch`: the module globals of the packages a run names (``RunRequest.watch_modules``,
  e.g. ``("deepspeed",)``), kept at the first run that names them; modules first imported during a run are
  watched from the end of that run on.
- :func:`fresh_process`: for a rank function that runs another harness's test as that harness's fresh
  process would (the compat plugin for torch's test bases), the scope of one test: what a fresh
  interpreter would start the next test with is put back when the test ends: the test module's own globals
  as its import left them (and those of the modules of the user's own it imported), ``sys.path``, the
  ``sys.modules`` entries of the user's code the test imported, ``os.environ``, the working directory,
  Python's signal handlers, torch's global settings (:func:`~.process_wide._torch_switches`) and, when it starts, torch's and
  Python's RNGs as a new process has them. What it finds reaches the parent with the run's
  :class:`ModuleStateWatch` (which hands it on), in the same warning.

Module globals are compared by binding and by the contents of every dict, list and set reachable from
them through dicts, lists and tuples (exact types; subclasses may not copy safely), each kept as a shallow
copy. After a run:

- a name bound to another object, or a name the run added: the old binding is put back (the added name is
  removed);
- a dict, list or set changed in place, at any depth: its contents are put back;
- anything that cannot be put back (a module that refuses the assignment, a signal handler, a torch
  setting without a setter) makes the worker unusable: the pool replaces it before the next run.

The report names what differs from what was kept, by structure: containers by type and contents, other
objects by identity (a fresh container holding what the old one held is not reported, and the old one is
put back). A cache (a name containing "cache") and c10d's tables of groups (which the world manages
itself) are put back without a report; what torch.compile adds to the globals of a module it compiled a
function of (names with two leading underscores: ``__compiled_fn_*``, ``__import_*``...) is left in place,
unreported: the compiled code cached on the function looks it up there. Each other difference is reported
(``module.name`` and what was done), and the parent warns with :class:`dstest.errors.StateLeftBehind`, a
finding about the code under test: it would have reached the next test. Not seen: an object changed through
its own attributes (``obj.field = x`` on a module-level object, a class attribute).

The package, one module per job: :mod:`~.module_globals` (the modules' globals, :class:`ModuleStateWatch`,
and the report a run's scopes add to), :mod:`~.process_wide` (:class:`ProcessState`: the process around a
test), :mod:`~.fresh_scope` (:func:`fresh_process`: the scope of one test).
"""

from __future__ import annotations

from dstest.worlds.process.state_watch.fresh_scope import (
    FreshProcess,
    close_held_scope,
    fresh_process,
    fresh_process_rng,
)
from dstest.worlds.process.state_watch.module_globals import ModuleStateWatch, take_pending
from dstest.worlds.process.state_watch.process_wide import ProcessState, restore_process_state, take_process_state

__all__ = [
    "FreshProcess",
    "ModuleStateWatch",
    "ProcessState",
    "close_held_scope",
    "fresh_process",
    "fresh_process_rng",
    "restore_process_state",
    "take_pending",
    "take_process_state",
]
