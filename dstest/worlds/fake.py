"""The fake world: this process plays rank r of N, collectives check shapes and move no data.

For partition and shape logic at sizes no machine could host (N in the tens of thousands). Each simulated
rank runs on its own thread with its own c10d state, so the caller's ``torch.distributed`` is untouched.
Outputs of collectives are left as they were: values are meaningless here, shapes and sizes are checked
exactly as in the threaded world.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

import dstest.trace as _trace
from dstest.context import RankContext, rank_seed
from dstest.errors import InvalidArgument, RankFailure, WorldTimeout
from dstest.worlds import collectives as C
from dstest.worlds import torch_internals
from dstest.worlds.core import c10d
from dstest.worlds.protocol import Capabilities
from dstest.worlds.request import RunRequest
from dstest.worlds.stopping import format_exception
from dstest.worlds.threaded.group import rank_process_group, register_backend
from dstest.worlds.threaded.waits import Done

__all__ = ["FakeWorld"]


class _FakeRendezvous:
    """Stands in for the threaded world's rendezvous: every call completes at once, after local checks."""

    faults = None  # the fake world injects no faults

    def __init__(self, world_size: int, recorder: _trace.Recorder | None = None) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.store = torch_internals.hash_store()
        self.recorder = recorder if recorder is not None else _trace.Recorder(world_size, "fake")

    def arrive(self, group: Any, call: C.Call) -> Done:
        call.check_local()
        seq = group.next_seq()
        done = Done(self, group.owner, call.outputs())
        done.record = self.recorder.collective(group, call, seq, group.owner)
        done.record.finished(None)
        return done

    def post_p2p(self, group: Any, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> Done:
        c10d.check_peer_rank(kind, peer, group.size_, f"group {group.label}")
        done = Done(self, group.owner, [tensor])
        done.record = self.recorder.p2p(group, kind, tensor, group.global_ranks[peer], tag, group.owner)
        done.record.finished(None)
        return done

    def wait(self, waitable: Any) -> None:
        if waitable.record is not None:
            waitable.record.waiting(self.recorder.logs.get(waitable.global_rank))
            waitable.record.waited()
        if waitable.error is not None:
            raise waitable.error

    def consume(self, waitable: Any) -> None:
        pass  # every call completes at once: nothing is left open

    def hand_out_future(self, waitable: Any, fut: Any) -> None:
        waitable._resolve(fut)

    def group_of(self, key: Any, global_rank: int) -> Any:
        return None  # one simulated rank per thread: no group crosses ranks


class FakeWorld:
    """Runs ``fn(ctx)`` as rank r of a world of N for each r in ``ranks`` (default: first and last rank).

    ``run`` returns the simulated ranks' results, in the order of ``ranks``.
    """

    name = "fake"
    marker = "cpu"
    #: No data moves and each simulated rank runs alone: nothing to poison, no peer to compare shapes with.
    capabilities = Capabilities()

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = tuple(ranks) if ranks is not None else None

    def unavailable_reason(self, world_size: int) -> str | None:
        return None

    def run(self, request: RunRequest) -> list[Any]:
        self.capabilities.refuse(request, self.name)
        world_size = request.world_size
        ranks = self.ranks if self.ranks is not None else tuple(sorted({0, world_size - 1}))
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise InvalidArgument(f"ranks={list(ranks)}: {bad} not in 0..{world_size - 1}")
        register_backend()
        with _trace.world_run(self.name, world_size, request.recorder) as recorder:
            return self._run(request, ranks, recorder)

    def close(self) -> None:
        """Nothing to stop: every simulated rank's thread ends with its run."""

    def _run(self, request: RunRequest, ranks: Sequence[int], recorder: _trace.Recorder) -> list[Any]:
        world_size, timeout, seed = request.world_size, request.timeout, request.seed
        results: list[Any] = []
        with torch_internals.thread_local_c10d_world() as c10d_world:
            for rank in ranks:
                box: dict[str, Any] = {}

                def rank_main(rank: int = rank, box: dict[str, Any] = box) -> None:
                    device = torch.device("cpu")
                    ctx = RankContext(rank=rank, world_size=world_size, world=self.name, device=device, seed=seed)
                    ctx.attach_comm(recorder.view(rank))
                    try:
                        rendezvous = _FakeRendezvous(world_size, recorder)
                        with rank_process_group(c10d_world, rendezvous, rank, device, timedelta(seconds=timeout)):
                            token = ctx.bind()
                            generator = torch.Generator()
                            generator.manual_seed(rank_seed(seed, rank))  # as a process of the rank (E5)
                            try:
                                with torch_internals.rank_generator(generator):
                                    box["result"] = request.rank_call(ctx)
                            finally:
                                RankContext.unbind(token)
                    except BaseException as exc:
                        box["error"] = exc  # formatted on the caller's thread (see dstest.worlds.stopping)

                thread = threading.Thread(target=rank_main, name=f"dstest-fake-rank{rank}", daemon=True)
                thread.start()
                thread.join(timeout)
                if thread.is_alive():
                    raise WorldTimeout(f"fake rank {rank} of {world_size} ran past its timeout of {timeout:g} s", {})
                if "error" in box:
                    text = format_exception(box["error"])
                    raise RankFailure(
                        f"fake rank {rank} of {world_size} failed: {box['error']!r}\n{text}",
                        {rank: text},
                        {rank: box["error"]},
                    )
                results.append(box.get("result"))
        return results
