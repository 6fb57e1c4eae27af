"""One posted call of a rank of the process world: what the cross-rank check knows of it until its verdict.

Shared by the checker (:mod:`dstest.worlds.process.checker`, which posts to the referee) and the check board
(:mod:`dstest.worlds.process.board_calls`, where ranks decide matching collectives without the parent).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PostedCall"]


class PostedCall:
    """One posted call of this rank: its verdict, the gloo work issued for it, whether anyone waited."""

    __slots__ = (
        "callbacks",
        "error",
        "event",
        "gid",
        "inner",
        "issue",
        "issue_error",
        "members",
        "msg",
        "ok",
        "on_board",
        "post_id",
        "posted_at",
        "record",
        "refereed",
        "sent",
        "seq",
        "waited",
        "what",
    )

    def __init__(self, post_id: int, what: str, issue: Callable[[], Any]) -> None:
        self.post_id = post_id
        self.what = what  # "all_reduce(float32[4]@cpu, op=sum) on group world (seq 3)"
        self.issue = issue
        self.event = threading.Event()
        self.error: tuple[str, str] | None = None  # (kind, message) from the referee
        self.inner: Any = None  # the gloo Work, once issued
        self.issue_error: BaseException | None = None  # gloo refused the call when it was issued
        self.waited = False
        self.callbacks: list[Callable[[], None]] = []
        self.record: Any = None  # the run's trace record of the call (dstest.trace)
        # A collective of a run with a board: its group, sequence number and members, whether its digest is
        # on the board, whether its message (``msg``) went to the referee, and the referee's "ok" if it came.
        self.gid = ""
        self.seq = 0
        self.members: Sequence[int] = ()
        self.on_board = False
        self.msg: tuple[Any, ...] = ()
        self.sent = True
        self.ok = False
        self.refereed = False  # the referee decides it whatever the board holds
        self.posted_at = 0.0
