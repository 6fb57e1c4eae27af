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
