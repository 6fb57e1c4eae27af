"""The structure every rank must agree on before values are compared: the same tensors by name, each with
the same shape and dtype over the same group; the first difference, or the lowest rank's order of names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from dstest.errors import InvalidArgument
from dstest.replicas.layouts import Entry

__all__ = ["Finding", "agree_on_structure"]


@dataclass
class Finding:
    """What differs, in a form every rank can agree on (picklable, compared by ``key``)."""

    index: int
    ranks: tuple[int, ...]
    text: str
    others: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        return (self.index, self.ranks)


#: How many names a message lists before "and N more".
_NAMES_SHOWN = 5

#: What each rank tells the others of one entry: (name, layout, group ranks, shape, dtype).
_Described = tuple[str, str, tuple[int, ...], tuple[int, ...], str]


def agree_on_structure(entries: list[Entry], pg: Any, ranks: tuple[int, ...]) -> tuple[list[Entry], Finding | None]:
    """Gather every rank's entries, described, over the group: this rank's entries in the lowest rank's order, and
    the first difference of structure (or None).

    Entries are matched by name (a dict compares by key, whatever order it was filled in), then put in the lowest
    rank's order: every rank then issues the same collectives in the same order, and :func:`~dstest.replicas.check._verdict` decides
    alike everywhere."""
    mine: list[_Described] = [
        (e.name, f"{e.layout}{'' if e.ranks == ranks else ' (subgroup)'}", e.ranks, e.shape, str(e.dtype))
        for e in entries
    ]
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=pg)
    order, finding = _match_structure(everyone, ranks)
    if finding is not None:
        return entries, finding
    by_key = {(name, layout): entry for (name, layout, *_), entry in zip(mine, entries)}
    return [by_key[key] for key in order], None


def _match_structure(
    everyone: Sequence[Sequence[_Described]], ranks: tuple[int, ...]
) -> tuple[list[tuple[str, str]], Finding | None]:
    """The keys (name, layout) in the lowest rank's order and the first difference of structure among every
    rank's described entries (``everyone[i]`` of ``ranks[i]``), or None. The same on every rank, from the same
    gathered lists: a name held twice by a rank (two dict keys with the same ``repr``) raises InvalidArgument on
    every rank, which cannot tell them apart."""
    keyed: list[dict[tuple[str, str], _Described]] = []
    for rank, theirs in zip(ranks, everyone):
        held: dict[tuple[str, str], _Described] = {}
        for described in theirs:
            key = (described[0], described[1])
            if key in held:
                raise InvalidArgument(
                    f"assert_replicas: rank {rank} holds two tensors named {key[0]} (dict keys whose repr() is the "
                    "same); replicas are matched by name across ranks: give them names that differ"
                )
            held[key] = described
        keyed.append(held)
    reference = list(keyed[0])
    known = set(reference)
    by_change: dict[tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]], list[int]] = {}
    for rank, held in zip(ranks, keyed):
        lacking = tuple(key for key in reference if key not in held)
        extra = tuple(key for key in held if key not in known)
        if lacking or extra:
            by_change.setdefault((lacking, extra), []).append(rank)
    if by_change:
        changes = []
        for (lacking, extra), members in by_change.items():
            said = []
            if lacking:
                said.append(f"lack {_listed(lacking, set(extra))}")
            if extra:
                said.append(f"hold {_listed(extra, set(lacking))} extra")
            changes.append(f"ranks {members} " + " and ".join(said))
        text = (
            f"the ranks hold different tensors (rank {ranks[0]} holds {len(reference)}: "
            f"{_listed(tuple(reference), set())}): " + "; ".join(changes)
        )
        return reference, Finding(-1, (), text)
    for index, key in enumerate(reference):
        by_group: dict[tuple[int, ...], dict[tuple[Any, ...], list[int]]] = {}
        for rank, held in zip(ranks, keyed):
            _, _, group_ranks, shape, dtype = held[key]
            by_group.setdefault(tuple(group_ranks), {}).setdefault((tuple(shape), dtype), []).append(rank)
        for group_ranks, kinds in sorted(by_group.items()):
            if len(kinds) > 1:
                kinds_text = " vs ".join(
                    f"ranks {members} {dtype.removeprefix('torch.')}{list(shape)}"
                    for (shape, dtype), members in kinds.items()
                )
                return reference, Finding(index, group_ranks, f"{key[0]} has different shapes or dtypes: {kinds_text}")
    return reference, None


def _listed(keys: tuple[tuple[str, str], ...], others: set[tuple[str, str]]) -> str:
    """Names for a message, the first few; a name that is also among ``others`` under another layout (a DTensor
    on one rank, a tensor on another) with its layout."""
    names_elsewhere = {name for name, _ in others}
    shown = [name if name not in names_elsewhere else f"{name} ({layout})" for name, layout in keys[:_NAMES_SHOWN]]
    more = len(keys) - _NAMES_SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")
