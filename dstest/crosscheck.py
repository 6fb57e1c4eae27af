"""``dstest.crosscheck``: one body on the threaded world and on the process world, compared (contract E14).

Rank threads share what processes do not: torch's caches and registries, a library's module globals, the
global RNG. dstest isolates what it knows of; this finds the next one before a user does. The same body
runs on each world (by reference, so the process world's workers can import it); the two must give

- the same verdict (both pass, or both fail),
- the same per-rank results (tensors equal in dtype, shape and values, or within ``rtol``/``atol``;
  containers and plain values equal), and
- the same collective trace per rank: op, group, sequence number, dtype, shapes, reduce op, root and
  peer of every call, in order.

The first difference raises :class:`~dstest.errors.WorldsDiverge` naming the rank, what differs and both
sides. Where the worlds differ, the threaded world is wrong until shown otherwise::

    results = dstest.crosscheck(body, 4, kwargs={"rows": 9})   # the threaded world's results
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from dstest.errors import InvalidArgument, RankFailure, WorldsDiverge
from dstest.worlds.request import DEFAULT_SEED, DEFAULT_TIMEOUT

__all__ = ["crosscheck", "trace_signature"]


def trace_signature(record: Any) -> tuple[Any, ...]:
    """What two worlds must agree on for one call of the trace (timings and call sites left out)."""
    return (
        record.op,
        record.group,
        record.seq,
        record.dtype,
        record.shapes,
        record.reduce_op,
        record.root,
        record.peer,
        record.tag,
    )


def _describe(sig: tuple[Any, ...]) -> str:
    op, group, seq, dtype, shapes, reduce_op, root, peer, _ = sig
    extra = [f"{dtype}{list(s)}" for s in shapes]
    extra += [f"op={reduce_op}"] if reduce_op else []
    extra += [f"root={root}"] if root is not None else []
    extra += [f"peer={peer}"] if peer is not None else []
    return f"{op}({', '.join(extra)}) on {group}" + (f" (seq {seq})" if seq is not None else "")


def _differs(a: Any, b: Any, rtol: float, atol: float, where: str) -> str | None:
    """Where and how ``a`` and ``b`` differ, or None."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        a, b = a.detach().cpu(), b.detach().cpu()
        same = torch.equal(a, b) if rtol == 0 and atol == 0 else torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if not same:
            diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "values"
            return f"{where}: tensors differ (largest difference {diff})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            why = _differs(a[k], b[k], rtol, atol, f"{where}[{k!r}]")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{where}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = _differs(x, y, rtol, atol, f"{where}[{i}]")
            if why:
                return why
        return None
    if isinstance(a, float) and isinstance(b, float) and (rtol or atol):
        return None if math.isclose(a, b, rel_tol=rtol, abs_tol=atol) else f"{where}: {a!r} vs {b!r}"
    try:
        equal = bool(a == b)
    except Exception:  # objects whose == is not a bool (arrays): compared by repr
        equal = repr(a) == repr(b)
    return None if equal else f"{where}: {a!r} vs {b!r}"


def _trace_difference(world_size: int, traces: dict[str, list[list[tuple[Any, ...]]]]) -> str | None:
    (first, a), (second, b) = traces.items()
    for rank in range(world_size):
        calls_a, calls_b = a[rank], b[rank]
        for i in range(max(len(calls_a), len(calls_b))):
            x = calls_a[i] if i < len(calls_a) else None
            y = calls_b[i] if i < len(calls_b) else None
            if x != y:
                return (
                    f"rank {rank}'s call {i + 1}: {first} world {_describe(x) if x else 'no call'}, "
                    f"{second} world {_describe(y) if y else 'no call'}"
                )
    return None


def crosscheck(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    worlds: Sequence[str] = ("threaded", "process"),
    timeout: float = DEFAULT_TIMEOUT,
    seed: int = DEFAULT_SEED,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> list[Any]:
    """Run ``fn`` on both ``worlds`` and compare verdicts, per-rank results and collective traces.

    Returns the first world's per-rank results. Raises :class:`WorldsDiverge` at the first difference, and
    the first world's :class:`RankFailure` when the body fails on both. ``rtol``/``atol`` compare floating
    results within a tolerance (default: bit for bit). ``fn`` must be importable by reference (a
    module-level function) for the process world.
    """
    from dstest.specification import run
    from dstest.trace import recording

    if len(worlds) != 2 or len(set(worlds)) != 2:
        raise InvalidArgument(f"crosscheck: worlds={list(worlds)!r}: name two different worlds")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise InvalidArgument(f"crosscheck: {name}={value!r}: must be a finite number >= 0")
    results: dict[str, list[Any]] = {}
    failures: dict[str, RankFailure] = {}
    traces: dict[str, list[list[tuple[Any, ...]]]] = {}
    for world in worlds:
        with recording() as rec:
            try:
                results[world] = run(fn, world_size, world=world, args=args, kwargs=kwargs, timeout=timeout, seed=seed)
            except RankFailure as err:
                failures[world] = err
        runs = rec.runs[-1:] if rec.runs else []
        traces[world] = [
            [trace_signature(c) for c in runs[0].view(r).calls] if runs else [] for r in range(world_size)
        ]
    name = getattr(fn, "__qualname__", repr(fn))
    if len(failures) == 2:
        raise failures[worlds[0]]
    if failures:
        bad = next(iter(failures))
        good = next(w for w in worlds if w not in failures)
        raise WorldsDiverge(
            f"{name} at world size {world_size} passes on the {good} world and fails on the {bad} world; "
            f"the {bad} world's failure:\n{failures[bad]}"
        ) from failures[bad]
    first, second = worlds
    for rank in range(world_size):
        why = _differs(results[first][rank], results[second][rank], rtol, atol, f"rank {rank}'s result")
        if why:
            raise WorldsDiverge(f"{name} at world size {world_size}: {why} ({first} world vs {second} world)")
    why = _trace_difference(world_size, traces)
    if why:
        raise WorldsDiverge(f"{name} at world size {world_size}: the collective traces differ at {why}")
    return results[first]
