"""impl's collectives are all counted: the uneven-shard allgather goes through :mod:`impl.comm.collectives`
(so a :class:`~impl.comm.CommStats` sees it, contract C6 and A8 are counted, not assumed), and no other module
of impl calls a ``torch.distributed`` collective itself.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

import dstest

pytestmark = pytest.mark.cpu

IMPL = Path(__file__).resolve().parents[1] / "impl"

#: torch.distributed functions that communicate (what impl must only call in impl/comm/collectives.py).
_COLLECTIVES = frozenset(
    {
        "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_reduce",
        "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
        "gather", "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_single",
        "reduce_scatter_tensor", "scatter", "send",
    }
)  # fmt: skip


def _dist_aliases(tree: ast.AST) -> set[str]:
    """Names the module binds to ``torch.distributed`` (``import torch.distributed as dist`` and the like)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == "_dist":  # collectives.py's lazy accessor
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _direct_collectives(path: Path) -> list[str]:
    """``name.fn(...)`` / ``torch.distributed.fn`` uses of a collective in ``path``, as ``line: text``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in _COLLECTIVES):
            continue
        owner = node.value
        direct = isinstance(owner, ast.Name) and owner.id in aliases
        dotted = isinstance(owner, ast.Attribute) and owner.attr == "distributed"
        via_accessor = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "_dist"
        if direct or dotted or via_accessor:
            found.append(f"{path.relative_to(IMPL.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_impl_comm_collectives_calls_torch_distributed_collectives() -> None:
    """The claim at the top of impl/comm/collectives.py, checked over every module of impl."""
    offenders = [
        hit
        for path in sorted(IMPL.rglob("*.py"))
        if path != IMPL / "comm" / "collectives.py"
        for hit in _direct_collectives(path)
    ]
    assert not offenders, "collectives outside impl/comm/collectives.py (not counted):\n" + "\n".join(offenders)


def test_the_static_check_sees_the_collectives_module() -> None:
    """The check above is not vacuous: it finds the calls in collectives.py itself."""
    hits = _direct_collectives(IMPL / "comm" / "collectives.py")
    assert any("all_reduce" in h for h in hits) and any("barrier" in h for h in hits), hits


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("grouped", [False, True], ids=["single", "grouped"])
def test_allgather_v_is_one_counted_all_gather(world_size: int, grouped: bool) -> None:
    """allgather_v and allgather_v_many issue exactly one counted "all_gather" at W > 1 (D5, D6), none at
    W = 1, and give the exact concatenation."""

    def body(ctx: Any) -> dict[str, int]:
        import torch.distributed as dist

        from impl.comm import Comm, CommStats
        from impl.ops import allgather_v, allgather_v_many

        W, r = ctx.world_size, ctx.rank
        counts = [2 * q + 1 for q in range(W)]  # uneven: 1, 3, 5, ...
        full = torch.arange(float(sum(counts)))
        start = sum(counts[:r])
        local = full[start : start + counts[r]].clone()
        stats = CommStats()
        comm = Comm(stats)
        if grouped:
            other = [0] * (W - 1) + [4]
            tail = torch.arange(4.0) + 100 if r == W - 1 else torch.zeros(0)
            got = allgather_v_many([local, tail], [counts, other], dist.group.WORLD, impl="reference", comm=comm)
            assert torch.equal(got[0], full) and torch.equal(got[1], torch.arange(4.0) + 100)
        else:
            got1 = allgather_v(local, counts, dist.group.WORLD, impl="reference", comm=comm)
            assert torch.equal(got1, full), f"rank {r}: {got1.tolist()}"
        return dict(stats.total)

    want = {"all_gather": 1} if world_size > 1 else {}
    assert dstest.run(body, world_size) == [want] * world_size


def test_allgather_v_uncounted_without_comm() -> None:
    """Without ``comm`` the gather still goes through impl's collectives (uncounted) and is exact."""

    def body(ctx: Any) -> list[float]:
        import torch.distributed as dist

        from impl.ops import allgather_v

        counts = [1, 2]
        local = torch.tensor([1.0]) if ctx.rank == 0 else torch.tensor([2.0, 3.0])
        return allgather_v(local, counts, dist.group.WORLD, impl="reference").tolist()  # type: ignore[no-any-return]

    assert dstest.run(body, 2) == [[1.0, 2.0, 3.0]] * 2
