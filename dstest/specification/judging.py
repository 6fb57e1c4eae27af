"""When the threaded world's verdict is not the last word (contract E14): ``--dstest-crosscheck`` runs a
sample of the threaded cases on the process world too and compares the two, and a threaded run whose rank
threads shared what processes would not is judged on the process world instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dstest.errors import RankFailure
from dstest.specification.bodies import refuse_unrun_results
from dstest.specification.info import Case, SpecInfo
from dstest.specification.skips import skip_if_every_rank_skipped
from dstest.worlds.request import RunRequest

__all__ = ["JUDGED_ON_PROCESSES", "crosschecked", "judge_on_processes", "sampled", "thread_shared"]


def thread_shared(world: Any, failure: RankFailure | None) -> list[str]:
    """What a threaded run shared between rank threads that processes would not: carried by its failure, or
    asked of the world after a pass (worlds without rank threads share nothing)."""
    if failure is not None:
        return list(getattr(failure, "thread_shared", None) or [])
    return world.thread_shared() if hasattr(world, "thread_shared") else []


def sampled(percent: int, case_name: str) -> bool:
    """Whether ``--dstest-crosscheck`` (``percent`` of the threaded cases, 100 for all) takes this case: the
    same cases run after run (a digest of the case's name), so a divergence found once is found again."""
    import zlib

    return percent >= 100 or (percent > 0 and zlib.crc32(case_name.encode()) % 100 < percent)


def crosschecked(
    info: SpecInfo, case: Case, threaded: Any, request_for: Callable[[str], RunRequest], judge: bool
) -> list[Any]:
    """``--dstest-crosscheck``: the threaded case also runs on the process world; verdicts, per-rank results
    and collective traces must agree bit for bit (:func:`dstest.compare.compare_outcomes`), else the test
    fails with :class:`~dstest.errors.WorldsDiverge` naming the first difference (contract E14)."""
    from dstest.compare import compare_outcomes, run_recorded
    from dstest.worlds import get_world

    first = run_recorded(case.world_size, lambda: threaded.run(request_for("threaded")))
    if first.failure is not None:
        skip_if_every_rank_skipped(info, first.failure)
    shared = thread_shared(threaded, first.failure)
    if judge and shared:
        return judge_on_processes(info, case, request_for("process"), shared, first.failure)
    process = get_world("process")
    if process.unavailable_reason(case.world_size) is not None:
        if first.failure is not None:
            raise first.failure
        return first.results or []
    second = run_recorded(case.world_size, lambda: process.run(request_for("process")))
    outcomes = {"threaded": first, "process": second}
    results = compare_outcomes(f"{info.name}[{case.id}]", case.world_size, outcomes, rtol=0.0, atol=0.0)
    refuse_unrun_results(results, info.source, generators=True)
    return results


#: Specs the threaded world handed to the process world this session (worker-local; the plugin reports them).
JUDGED_ON_PROCESSES: list[str] = []


def judge_on_processes(
    info: SpecInfo, case: Case, request: RunRequest, shared: list[str], threaded: BaseException | None
) -> list[Any]:
    """A threaded run that shared what processes would not (contract E14): the process world's verdict counts.

    The threaded verdict, pass or fail, is not trusted where rank threads shared state: a rank's patch of a
    module, a module global holding a rank's group, torch's generator used by name. The same request runs on
    the process world; its failure is raised with the threaded one as a note, its pass passes the test, and
    either way the test is named in the session summary so that it can be marked ``worlds=["process"]``."""
    from dstest.worlds import get_world

    process = get_world("process")
    first = str(threaded).splitlines()[0] if threaded is not None else "passed"
    why = "; ".join(shared)
    entry = f"{why} (threaded: {first[:200]})"
    reason = process.unavailable_reason(case.world_size)
    if reason is not None:
        if threaded is not None:
            threaded.add_note(f"dstest: rank threads shared state ({why}); the process world could not judge: {reason}")
            raise threaded
        raise RankFailure(
            f"the threaded run passed, but rank threads shared state ({why}), and the process world could not "
            f'judge it: {reason}. Mark the spec worlds=["process"] where processes are available.',
            {},
        )
    JUDGED_ON_PROCESSES.append(entry)
    try:
        results = process.run(request)
    except RankFailure as failure:
        failure.add_note(
            f"dstest: judged on the process world because rank threads shared state ({why}); "
            f"the threaded world's verdict: {first}"
        )
        raise
    refuse_unrun_results(results, info.source, generators=True)
    return results
