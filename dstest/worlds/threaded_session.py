"""The threaded world's session: the rendezvous of :class:`~dstest.worlds._session.Session` plus what only rank
threads need, because they share one process: the watch on module globals that hold a rank's process group (a
library keeping its groups there sees one rank's on every rank thread), and on torch's process-wide generator
(each rank draws from its own; code that calls ``torch.default_generator``'s methods reaches the shared one),
both named in failure reports.
"""

from __future__ import annotations

from typing import Any

import torch

from dstest.worlds import torch_internals as _compat
from dstest.worlds._session import Session

__all__ = ["ThreadedSession"]


#: Packages whose module globals are not the code under test's (dstest's own, torch's, the test runner's).
_NOT_LIBRARY_STATE = frozenset({"dstest", "torch", "_pytest", "pytest", "pluggy", "hypothesis", "threading"})


def _group_in(value: Any, session: Any) -> Any:
    """A group of ``session`` that ``value`` is or holds directly (a list, tuple or dict of groups), or None."""
    from dstest.worlds._backend import Group

    if isinstance(value, Group):
        return value if value.session is session else None
    if isinstance(value, (list, tuple)):
        return next((v for v in value if isinstance(v, Group) and v.session is session), None)
    if isinstance(value, dict):
        return next((v for v in value.values() if isinstance(v, Group) and v.session is session), None)
    return None


class _SharedGlobals:
    """Module globals that hold a rank's process group, seen from the modules that create groups.

    Each time a rank makes a group, the modules on its stack outside torch and dstest (the library calling
    ``new_group``: Megatron's ``parallel_state``) are watched, and their globals are looked through for this
    world's groups: a library that keeps its groups there (``_TENSOR_MODEL_PARALLEL_GROUP = group``) holds
    one rank's group for every rank thread, where each process has its own. Looked at when groups are made
    (a library makes many in a row), never per collective; named in a failure report.
    """

    def __init__(self) -> None:
        self.watched: dict[str, dict[str, Any]] = {}
        self.found: dict[str, str] = {}
        self.failed_in: str | None = None

    def group_made(self, session: Any) -> None:
        import sys

        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if isinstance(name, str) and name.split(".", 1)[0] not in _NOT_LIBRARY_STATE:
                self.watched.setdefault(name, frame.f_globals)
            frame = frame.f_back  # type: ignore[assignment]
        self.look(session)

    def look(self, session: Any) -> None:
        for name, module_globals in list(self.watched.items()):
            for attr, value in list(module_globals.items()):
                group = _group_in(value, session)
                if group is not None and f"{name}.{attr}" not in self.found:
                    self.found[f"{name}.{attr}"] = f"rank {group.owner}'s group {group.label}"

    def failed(self, session: Any, exc: BaseException) -> None:
        """A rank failed: look again, and remember where, if it failed in a module that makes groups."""
        self.look(session)
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            name = frame.f_globals.get("__name__", "")
            if name in self.watched and frame.f_globals is self.watched[name]:
                self.failed_in = f"{name}.{frame.f_code.co_name}"
            tb = tb.tb_next

    def note(self) -> str:
        if not self.found and self.failed_in is not None:
            return (
                f"\nnote: the rank failed in {self.failed_in}, code of a module that makes this world's process "
                "groups. Rank threads share a module's globals, where each process of a world has its own: if it "
                "keeps its groups or state there (as Megatron's parallel_state does), every rank sees one rank's. "
                'Run such code with world="process" (@dstest.spec(worlds=["process"])).'
            )
        if not self.found:
            return ""
        items = [f"{where} ({what})" for where, what in self.found.items()]
        shown = "; ".join(items[:4]) + (f"; and {len(items) - 4} more" if len(items) > 4 else "")
        return (
            f"\nnote: module globals held this world's process groups: {shown}. Rank threads share a module's "
            "globals, where each process of a world has its own, so a library that keeps its groups there (as "
            "Megatron's parallel_state does) sees one rank's state on every rank. Run such code with "
            'world="process" (@dstest.spec(worlds=["process"])).'
        )


class ThreadedSession(Session):
    """A session of rank threads: adds the watch on what rank threads share that processes would not."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._shared_rng_state = torch.default_generator.get_state()
        self.shared_globals = _SharedGlobals()

    def register_group(self, group: Any) -> None:
        super().register_group(group)
        _compat.hold_late_imports()
        self.shared_globals.group_made(self)

    def rng_note(self) -> str:
        """For a failure report: whether torch's process-wide generator moved during the run.

        Each rank thread draws from a generator of its own (``torch_internals.rank_rng``); what still reaches
        the shared one is code that calls ``torch.default_generator``'s own methods (``manual_seed``,
        ``set_state``), which every rank thread shares where each process has its own."""
        if torch.equal(torch.default_generator.get_state(), self._shared_rng_state):
            return ""
        return (
            "\nnote: torch's process-wide generator (torch.default_generator) moved during the run. Each rank "
            "thread draws from a generator of its own, but code that calls torch.default_generator's methods "
            "(manual_seed, set_state) reaches the one object all rank threads share, where each process has its "
            "own. Use torch.manual_seed / torch.set_rng_state (per rank on threads), or run the spec with "
            'worlds=["process"].'
        )

    def reset(self) -> None:
        super().reset()
        self._shared_rng_state = torch.default_generator.get_state()
        self.shared_globals = _SharedGlobals()
