"""One run on this rank: the body on a thread of its own while the rank's thread watches the store for a
peer's failure and the timeout; the rank's outcome posted, the run's group torn down."""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from typing import Any

from dstest.errors import WorldAborted
from dstest.worlds.launched.connection import Launch
from dstest.worlds.launched.outcomes import REPORT_GRACE_S, Outcome, failure, form_limit
from dstest.worlds.request import RunRequest

__all__ = ["ABORT_GRACE_S", "RankRun"]

#: Seconds the ranks still running get, after a peer failed, to see their own calls fail and return.
ABORT_GRACE_S = 3.0


class RankRun:
    def __init__(
        self,
        launch: Launch,
        key: str,
        request: RunRequest,
    ) -> None:
        self.launch, self.key, self.request = launch, key, request
        self.world_size, self.timeout, self.seed = request.world_size, request.timeout, request.seed
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.formed_at: float | None = None  # time.monotonic() when the run's group formed

    def execute(self) -> None:
        launch, rank = self.launch, self.launch.rank
        thread = threading.Thread(target=self._body, name=f"dstest-launched-r{rank}", daemon=True)
        # The timeout bounds the body: its clock starts once the run's group has formed, since each launched
        # rank connects when its own process gets there (slow on a busy machine); forming has a limit of its
        # own (form_limit), which is also the group's own timeout (init_process_group's, below).
        deadline = time.monotonic() + form_limit(self.timeout)
        thread.start()
        failed_key = self.key + "failed"
        stopped = ""
        pause = 0.001
        formed_seen = False
        while not self.done.wait(pause):
            pause = min(pause * 2, 0.05)
            if launch.has(failed_key):
                stopped = "aborted"
                break
            if not formed_seen and self.formed_at is not None:
                formed_seen = True
                deadline = self.formed_at + self.timeout
            if time.monotonic() >= deadline:
                stopped = "timeout"
                break
        if not stopped and self.error is not None and launch.has(failed_key):
            # The body ended with an error after a peer had failed: the peer posts its failure before it
            # tears its group down, which is what failed this rank's pending call (gloo). A consequence.
            outcome = failure(rank, self.error, "aborted", note=f"rank {rank} stopped because another rank failed\n")
        elif not stopped:
            if self.error is not None:
                launch.post(failed_key, str(rank).encode())
            outcome = self._finished()
        else:
            outcome = self._stop(thread, stopped)
        self._teardown(thread)
        launch.post(self.key + f"out/{rank}", pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL))

    def _body(self) -> None:
        import datetime
        import random

        import torch
        import torch.distributed as dist

        from dstest.context import RankContext, rank_seed

        launch, rank = self.launch, self.launch.rank
        try:
            from dstest.worlds.torch_internals import prefix_store

            store = prefix_store(self.key + "pg/", launch.pg_store)
            dist.init_process_group(
                launch.backend,
                store=store,
                rank=rank,
                world_size=self.world_size,
                # Forming waits up to form_limit; past the run's timeout the watching thread has already
                # reported, so the backend's own timeout only has to end calls that nothing else ends.
                timeout=datetime.timedelta(seconds=form_limit(self.timeout)),
                device_id=launch.device if launch.backend == "nccl" else None,
            )
            self.formed_at = time.monotonic()
            ctx = RankContext(
                rank=rank, world_size=self.world_size, world="launched", device=launch.device, seed=self.seed
            )
            # A process owns its global RNGs: seed them as the process world does (E5).
            torch.manual_seed(rank_seed(self.seed, rank))
            random.seed(rank_seed(self.seed, rank))
            token = ctx.bind()
            try:
                self.value = self.request.rank_call(ctx)
            finally:
                RankContext.unbind(token)
        except BaseException as exc:  # every outcome is reported to the peers
            self.error = exc
        finally:
            self.done.set()

    def _finished(self) -> Outcome:
        rank = self.launch.rank
        if self.error is None:
            try:
                blob = pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                err = TypeError(
                    f"rank {rank} returned {type(self.value).__name__} {self.value!r:.200}, which cannot be "
                    f"pickled to the other ranks ({type(exc).__name__}: {exc}); return picklable values"
                )
                self.launch.post(self.key + "failed", str(rank).encode())
                return failure(rank, err, "failed")
            return Outcome(rank, True, result=blob)
        return failure(rank, self.error, "failed")

    def _stop(self, thread: threading.Thread, why: str) -> Outcome:
        """The run ended for this rank without its body finishing: a peer failed, or the timeout passed."""
        from dstest.worlds.stopping import stacks_of

        rank = self.launch.rank
        if why == "aborted":
            # The failed peer tears its group down, which fails this rank's pending call: give the body
            # the chance to return by itself before it is reported as stopped.
            self._abort_group()
            if self.done.wait(ABORT_GRACE_S):
                err = self.error if self.error is not None else WorldAborted("a peer failed")
                return failure(rank, err, "aborted", note=f"rank {rank} stopped because another rank failed\n")
        stack = stacks_of([thread]).get(0, "(no stack: the thread ended)\n")
        if why == "timeout" and self.formed_at is None:
            text = f"rank {rank}'s group for the run had not formed within {form_limit(self.timeout):g} s (a peer "
            text += f"never connected); its stack:\n{stack}"
        elif why == "timeout":
            text = f"rank {rank} was still running after the run's timeout of {self.timeout:g} s; its stack:\n{stack}"
        else:
            text = f"rank {rank} did not stop within {ABORT_GRACE_S:g} s of another rank's failure; its stack:\n{stack}"
        return Outcome(rank, False, traceback=text, exception=None, kind=why)

    def _abort_group(self) -> None:
        """Make the run's pending NCCL calls return (gloo calls fail when a peer's group closes)."""
        if self.launch.backend != "nccl" or self.formed_at is None:
            return
        from dstest.worlds.torch_internals import abort_process_group

        with contextlib.suppress(Exception):
            abort_process_group()

    def _teardown(self, thread: threading.Thread) -> None:
        """Destroy the run's groups; a body still running is interrupted and its group abandoned."""
        from dstest.worlds.stopping import reap

        if thread.is_alive():
            self._abort_group()
            reap([thread], ABORT_GRACE_S)  # WorldAborted is raised into it when it next runs Python code
        closer = threading.Thread(target=_destroy_groups, name="dstest-launched-teardown", daemon=True)
        closer.start()
        closer.join(ABORT_GRACE_S + REPORT_GRACE_S)
        if closer.is_alive():
            self.launch.broken = (
                "the process group of an earlier run could not be destroyed (a rank's thread is still inside "
                "one of its calls); later runs cannot form a group"
            )


def _destroy_groups() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
