"""assert_replicas' details that mutation testing showed no fast test pinned down (docs/checking-the-checkers.md).

``bash ci/mutation.sh dstest/replicas.py`` runs mutmut over :mod:`dstest.replicas` with the checker's
properties (tests/test_checker_properties_replicas.py), the threaded world's tests of tests/test_replicas.py
and this file. Each test here states what contract G4 promises (every rank of the group gets the same verdict,
the message names what differs, where and by how much; bad arguments are refused before any collective) and
fails for at least one mutant that survived the others. On the threaded world only (a few ms a run): the
process world runs the same module, and tests/test_replicas.py runs both.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dstest
from dstest.context import RankContext
from dstest.errors import InvalidArgument

pytestmark = pytest.mark.cpu


def _refusals(ctx: RankContext, settings: list[dict[str, Any]]) -> list[str]:
    """Each setting's refusal, every rank alone (no collective may start), then one barrier: still in step."""
    out = []
    for kwargs in settings:
        with pytest.raises(InvalidArgument) as info:
            dstest.assert_replicas([torch.zeros(2)], **kwargs)
        out.append(str(info.value))
    dist.barrier()
    return out


BAD_TOLERANCES: list[tuple[dict[str, Any], str]] = [
    ({"rtol": -1e-9}, "rtol=-1e-09: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"atol": -1}, "atol=-1: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"rtol": math.inf}, "rtol=inf: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"atol": math.nan}, "atol=nan: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"rtol": True}, "rtol=True: must be a finite number >= 0 (0 compares bit for bit)"),
    ({"atol": "0"}, "atol='0': must be a finite number >= 0 (0 compares bit for bit)"),
    ({"what": 3}, "what=3: must be a str naming what is compared, or None"),
]


def test_bad_tolerances_and_names_are_refused_in_full_on_every_rank() -> None:
    settings = [kwargs for kwargs, _ in BAD_TOLERANCES]
    expected = [text for _, text in BAD_TOLERANCES]
    assert dstest.run(_refusals, 2, args=(settings,)) == [expected, expected]
