"""``ctx.comm``: counts and bytes of one rank's collectives and transfers, for the whole run or a window."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dstest.trace.records import CallRecord, RankLog, Window, group_label
from dstest.worlds.core.c10d import RECORDED_OPS


def _check_op(op: str | None) -> None:
    if op is not None and op not in RECORDED_OPS:
        from dstest.errors import InvalidArgument

        raise InvalidArgument(
            f"op={op!r} is not a collective or transfer dstest records; allowed: {list(RECORDED_OPS)}"
        )


class CommView:
    """Counts and bytes of one rank's collectives and transfers: ``ctx.comm`` (the run so far) or a
    window of it (``with ctx.comm.window() as w: ...``).

    ``op`` names a collective as torch.distributed does (``"all_reduce"``, ``"all_gather_into_tensor"``,
    ``"send"``, ...); ``group`` is a process group (as passed to the collective; None: every group) or
    its label (see :func:`group_label`). What a call counts is in :mod:`dstest.trace`: for
    an all-gather, the gathered output (W x the shard).

    Per rank, on a group of W ranks::

        dist.all_gather_into_tensor(out[W*P], shard[P])   ctx.comm.numel("all_gather_into_tensor") == W*P
        dist.all_reduce(t[N])                              ctx.comm.count("all_reduce") == 1
    """

    def __init__(self, log: RankLog, window: Window | None = None) -> None:
        self._log = log
        self._window = window

    def _totals(self) -> dict[tuple[str, str], list[int]]:
        with self._log.lock:
            src = self._window.totals if self._window is not None else self._log.totals
            return {k: list(v) for k, v in src.by_key.items()}

    def _sum(self, column: int, op: str | None, group: Any) -> int:
        _check_op(op)
        label = None if group is None else (group if isinstance(group, str) else group_label(group))
        return sum(
            row[column]
            for (g, o), row in self._totals().items()
            if (op is None or o == op) and (label is None or g == label)
        )

    @property
    def rank(self) -> int:
        return self._log.rank

    def count(self, op: str | None = None, group: Any = None) -> int:
        """How many calls (of ``op``, on ``group``)."""
        return self._sum(0, op, group)

    def numel(self, op: str | None = None, group: Any = None) -> int:
        """Elements the calls counted (see the table of :mod:`dstest.trace`)."""
        return self._sum(1, op, group)

    def bytes(self, op: str | None = None, group: Any = None) -> int:
        """Bytes the calls counted: elements x element size."""
        return self._sum(2, op, group)

    def counts(self) -> dict[str, int]:
        """Calls by op, every group together: ``{"all_reduce": 2, "broadcast": 1}``."""
        out: dict[str, int] = {}
        for (_, op), row in self._totals().items():
            out[op] = out.get(op, 0) + row[0]
        return out

    def bytes_by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, op), row in self._totals().items():
            out[op] = out.get(op, 0) + row[2]
        return out

    def by_group(self) -> dict[str, dict[str, tuple[int, int]]]:
        """``{group label: {op: (calls, bytes)}}``."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for (g, op), row in self._totals().items():
            out.setdefault(g, {})[op] = (row[0], row[2])
        return out

    @property
    def calls(self) -> list[CallRecord]:
        """The records, oldest first (the whole run keeps the last :data:`RECORD_LIMIT`)."""
        with self._log.lock:
            return list(self._window.records if self._window is not None else self._log.records)

    @contextlib.contextmanager
    def window(self) -> Iterator[CommView]:
        """Count only what this rank posts inside the block (the view stays readable afterwards)."""
        win = Window()
        with self._log.lock:
            self._log.windows.append(win)
        try:
            yield CommView(self._log, win)
        finally:
            with self._log.lock:
                self._log.windows.remove(win)

    def __repr__(self) -> str:
        return f"<CommView rank {self.rank}: {self.counts()}>"
