"""The names of the collectives dstest knows come from one table, the c10d table of
:mod:`dstest.worlds.core.c10d`: the ``Call`` classes by op, the ops ``ctx.comm`` and faults accept, the kinds
a program holds, the DeepSpeed backend methods counted. A new collective is added to the table and reaches
all of them; no module keeps a list of its own that the table could leave behind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dstest
from dstest.errors import InvalidArgument
from dstest.worlds.core.c10d import COLLECTIVES, METHODS, RECORDED_OPS, TRANSFERS

pytestmark = pytest.mark.cpu

_PACKAGE = Path(dstest.__file__).parent
_TABLE = _PACKAGE / "worlds" / "core" / "c10d.py"


def test_the_table_gives_each_collective_once_and_the_transfers() -> None:
    assert COLLECTIVES[:3] == ("all_reduce", "broadcast", "reduce") and len(set(COLLECTIVES)) == len(COLLECTIVES)
    assert {m.op for m in METHODS if m.op} == set(COLLECTIVES)
    assert TRANSFERS == ("send", "recv") and RECORDED_OPS == COLLECTIVES + TRANSFERS


def test_every_list_of_collective_names_is_the_tables() -> None:
    from dstest.faults import FAULT_OPS
    from dstest.programs import KINDS
    from dstest.targets._deepspeed_engine import _COLLECTIVES as DEEPSPEED_METHODS
    from dstest.worlds.collectives import CALLS

    assert list(CALLS) == list(COLLECTIVES) and all(cls.op == op for op, cls in CALLS.items())
    assert FAULT_OPS == frozenset(COLLECTIVES)
    assert KINDS[: len(COLLECTIVES)] == COLLECTIVES
    assert set(RECORDED_OPS) <= set(DEEPSPEED_METHODS)


def test_ctx_comm_accepts_every_recorded_op_and_names_them_when_refusing_another() -> None:
    def body(ctx: dstest.RankContext) -> list[int]:
        counts = [ctx.comm.count(op) for op in RECORDED_OPS]
        with pytest.raises(InvalidArgument) as err:
            ctx.comm.count("allreduce")
        assert f"allowed: {list(RECORDED_OPS)}" in str(err.value)
        return counts

    assert dstest.run(body, 2) == [[0] * len(RECORDED_OPS)] * 2


def _literal(node: ast.expr | None) -> ast.Tuple | ast.List | ast.Set | None:
    """The literal collection ``node`` is, or wraps (``frozenset((...))``), if any."""
    if isinstance(node, ast.Call) and len(node.args) == 1:
        node = node.args[0]
    return node if isinstance(node, ast.Tuple | ast.List | ast.Set) else None


def _name_lists(path: Path) -> list[int]:
    """Lines of ``path`` that name a collection of five or more of the table's op names (an assignment of a
    literal tuple, list or set, or of one wrapped in a call)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Assign | ast.AnnAssign) or (literal := _literal(node.value)) is None:
            continue
        names = {e.value for e in literal.elts if isinstance(e, ast.Constant) and e.value in RECORDED_OPS}
        if len(names) >= 5:
            found.append(node.lineno)
    return found


def test_no_module_of_dstest_keeps_a_list_of_collective_names_of_its_own() -> None:
    """Which ops follow one rule (``if op in ("all_reduce", "reduce", "broadcast")``) is the rule's business;
    a named collection of five or more of the names is a list the table should have made."""
    lists = {
        str(path.relative_to(_PACKAGE)): lines
        for path in sorted(_PACKAGE.rglob("*.py"))
        if path != _TABLE and (lines := _name_lists(path))
    }
    assert lists == {}
