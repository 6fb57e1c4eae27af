"""The checking core's details that mutation testing showed no test pinned down (docs/checking-the-checkers.md).

``bash ci/mutation.sh dstest/worlds/core/matching.py dstest/worlds/core/c10d.py`` runs mutmut over the core
with tests/test_checker_properties_matching.py, this file and tests/test_core.py. Each test here fails for at
least one mutant that survived those properties and changes what a user sees: an error's text or type, a
boundary (a peer rank equal to the group size), a default (a transfer's tag), the c10d methods a group class
gets. The mutants that change nothing are listed, each with the reason, on the docs page.

``c10d.install`` runs when a world's group class is defined, at import, before mutmut can switch a mutant in;
so the tests here that need it call it themselves, on a class of their own.
"""

from __future__ import annotations

from typing import Any

import pytest

from dstest.errors import InvalidArgument
from dstest.worlds.core import c10d, matching

pytestmark = pytest.mark.cpu

METHOD = {m.name: m for m in c10d.METHODS}


class _Dev:
    type = "cpu"


class _Meta:
    """A float32 buffer's metadata, as the process world posts it (the core needs no tensor)."""

    dtype = "float32"
    device = _Dev()

    def __init__(self, *shape: int) -> None:
        self.shape = shape


# -- c10d: one tensor per rank, peers, binding ---------------------------------------------------------------
def test_one_tensor_takes_the_single_tensor_and_names_the_count_otherwise() -> None:
    t = object()
    assert c10d.one_tensor([t], "broadcast") is t
    for tensors in ([], [t, t]):
        with pytest.raises(InvalidArgument) as info:
            c10d.one_tensor(tensors, "broadcast")
        assert str(info.value) == f"broadcast: expected exactly one tensor per rank, got {len(tensors)}"


@pytest.mark.parametrize("size", [1, 3])
def test_a_peer_is_a_rank_of_its_group_from_0_to_size_minus_1(size: int) -> None:
    for peer in (0, size - 1):
        c10d.check_peer_rank("send", peer, size, "group world")
    for peer in (-1, size):
        with pytest.raises(InvalidArgument) as info:
            c10d.check_peer_rank("recv", peer, size, "group 1 [0, 2]")
        assert str(info.value) == f"recv: peer rank {peer} is not in group 1 [0, 2] (group ranks 0..{size - 1})"


def test_bind_fills_the_defaults_and_refuses_unknown_or_missing_arguments() -> None:
    send, allreduce = METHOD["send"], METHOD["allreduce"]
    t = object()
    assert c10d.bind(send, ([t], 1), {}) == {"tensors": [t], "dst": 1, "tag": 0}
    assert c10d.bind(send, ([t],), {"dst": 1, "tag": 5}) == {"tensors": [t], "dst": 1, "tag": 5}
    assert c10d.bind(allreduce, ([t],), {}) == {"tensors": [t], "opts": None}
    with pytest.raises(TypeError) as info:
        c10d.bind(send, ([t],), {"dst": 1, "zeta": 2, "alpha": 3})
    assert str(info.value) == "send() got unexpected keyword arguments ['alpha', 'zeta']"
    with pytest.raises(TypeError) as info:
        c10d.bind(send, ([t],), {"tag": 2})
    assert str(info.value) == "send() missing argument 'dst'"


class _Plain:
    """A group class of this test's own: what its installed c10d methods hand to ``_c10d``."""

    def _c10d(self, method: c10d.Method, args: dict[str, Any]) -> Any:
        return method, args


def test_install_gives_a_class_every_c10d_method_each_passing_its_arguments_by_name() -> None:
    cls = c10d.install(type("Installed", (_Plain,), {}))
    assert cls.__name__ == "Installed"
    group = cls()
    for method in c10d.METHODS:
        fn = getattr(cls, method.name)
        assert fn.__name__ == fn.__qualname__ == method.name
        assert fn.__doc__ == f"c10d's ``{method.name}({', '.join(method.params)})`` (see dstest.worlds.core.c10d)."
        values = [object() for _ in method.params]
        expected = dict(zip(method.params, values))
        assert getattr(group, method.name)(*values) == (method, expected)  # as torch calls them
        assert getattr(group, method.name)(**expected) == (method, expected)
        assert getattr(group, method.name)(values[0], **dict(zip(method.params[1:], values[1:]))) == (method, expected)
    for alias, name in c10d.ALIASES.items():
        assert getattr(cls, alias) is getattr(cls, name)
    with pytest.raises(InvalidArgument) as info:
        group.recv_anysource([object()])
    assert str(info.value) == "recv without src (any source) is not supported by dstest's worlds: pass src"


def test_an_installed_method_called_without_its_optional_arguments_gets_their_defaults() -> None:
    group = c10d.install(type("Installed", (_Plain,), {}))()
    t = object()
    assert group.send([t], 1) == (METHOD["send"], {"tensors": [t], "dst": 1, "tag": 0})
    assert group.barrier() == (METHOD["barrier"], {"opts": None})
    with pytest.raises(TypeError) as info:
        group.broadcast()
    assert str(info.value) == "broadcast() missing argument 'tensors'"


def test_matching_names_its_finished_phrase() -> None:
    assert matching.FINISHED == "finished its function"


def test_an_installed_method_refuses_an_unknown_keyword_even_with_every_positional_argument() -> None:
    group = c10d.install(type("Installed", (_Plain,), {}))()
    with pytest.raises(TypeError) as info:
        group.send([object()], 1, 0, timeout=5)
    assert str(info.value) == "send() got unexpected keyword arguments ['timeout']"


# -- matching: the texts of transfers whose peer left ----------------------------------------------------------
@pytest.mark.parametrize(("kind", "other"), [("send", "recv"), ("recv", "send")])
def test_a_transfer_whose_peer_left_names_the_side_that_never_came(kind: str, other: str) -> None:
    text = matching.p2p_left_text(0, f"{kind}(float32[2]@cpu ...)", kind, 1, "failed (ValueError: x)")
    assert text == (
        f"rank 0 called {kind}(float32[2]@cpu ...), but rank 1 failed (ValueError: x) without a matching "
        f"{other}: the transfer can never complete"
    )
    assert matching.p2p_left_text(2, "w", kind, 3).startswith(f"rank 2 called w, but rank 3 {matching.FINISHED} ")


def test_a_transfer_is_described_with_its_direction() -> None:
    buffer = _Meta(4)
    assert matching.p2p_describe("send", buffer, 1, 0, "group world") == (
        "send(float32[4]@cpu to rank 1, tag=0) on group world"
    )
    assert matching.p2p_describe("recv", buffer, 2, 7, "group 1 [0, 2]") == (
        "recv(float32[4]@cpu from rank 2, tag=7) on group 1 [0, 2]"
    )


# -- matching: a member that left after posting its side -------------------------------------------------------
class _Call:
    """A stand-in for one rank's side of a collective (the core needs only these four methods)."""

    def __init__(self, group_rank: int) -> None:
        self.group_rank = group_rank

    def describe(self) -> str:
        return f"op(from {self.group_rank})"

    def key(self) -> tuple[Any, ...]:
        return ("op",)

    def check_peer(self, first: Any) -> str | None:
        return None

    def check_all(self, calls: Any) -> str | None:
        return None


def test_a_member_that_left_after_posting_is_named_with_the_side_it_never_waited_for() -> None:
    """The process world issues a collective when every rank posted it; a rank that posts and leaves without
    waiting dooms the others' sides: the text says so, and which ranks have not joined."""
    ex = matching.Exchange((1, 3, 5), "2 [1, 3, 5]", 4)
    assert ex.join(_Call(1)) is None and ex.join(_Call(0)) is None
    assert ex.left({3}) is None  # it joined: it is not missing
    assert ex.left_text(3, "failed (ValueError: x)") == (
        "collective on group 2 [1, 3, 5] (seq 4) cannot complete: rank 3 failed (ValueError: x) without waiting "
        "for its op(from 1), and ranks [5] have not joined; rank 1 called op(from 0); rank 3 called op(from 1)"
    )
    assert ex.left_text(5) == (
        f"rank 5 {matching.FINISHED} without joining op(from 1) on group 2 [1, 3, 5] (seq 4) (rank 1 called "
        "op(from 0); rank 3 called op(from 1)): it can never complete"
    )


def test_only_the_default_group_of_every_rank_is_called_world() -> None:
    assert matching.group_label("0", (0, 1, 2), 3) == "world"
    assert matching.group_label("1", (0, 1, 2), 3) == "1 [0, 1, 2]"  # a new group of every rank
    assert matching.group_label("0", (0, 2), 3) == "0 [0, 2]"


def test_a_scatter_list_entry_of_another_shape_is_refused_on_the_root() -> None:
    """gloo refuses a scatter_list entry whose shape differs from the output's, even with as many elements:
    so does the local check (``signature`` is strict unless told otherwise)."""
    import torch

    from dstest.worlds import collectives as C

    call = C.Scatter(0, 2, torch.empty(6), [torch.empty(6), torch.empty(2, 3)], 0)
    with pytest.raises(InvalidArgument) as info:
        call.check_local()
    assert str(info.value) == "scatter: scatter_list[1] is float32[2, 3]@cpu, the output is float32[6]@cpu"
