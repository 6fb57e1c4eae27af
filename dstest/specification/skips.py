"""A skip inside a spec, reported where it happened: at the line of the spec body's file that called
``pytest.skip`` (or at the body's ``def`` line when the world cannot host the case), not inside dstest."""

from __future__ import annotations

import inspect
import re
from types import TracebackType

from dstest.errors import RankFailure
from dstest.specification.info import SKIP_LOCATION_ATTR, SpecInfo

__all__ = ["skip", "skip_if_every_rank_skipped", "skip_location"]


_FRAME_LINE = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in ', re.MULTILINE)


def skip_location(info: SpecInfo, exc: BaseException | None, text: str | None) -> tuple[str, int]:
    """Where a skip inside a spec happened, as pytest reports it: ``(path, 1-based line)``.

    The innermost frame in the spec body's file: from the rank's traceback object (in-process worlds),
    else from its formatted traceback (the process world), else the body's ``def`` line.
    """
    code = getattr(inspect.unwrap(info.source), "__code__", None)
    if code is None:
        return ("<unknown>", 0)
    path = code.co_filename
    found: int | None = None
    tb: TracebackType | None = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            found = tb.tb_lineno
        tb = tb.tb_next
    if found is None and text:
        lines = [int(m["line"]) for m in _FRAME_LINE.finditer(text) if m["path"] == path]
        found = lines[-1] if lines else None
    return (path, found if found is not None else code.co_firstlineno)


def skip(reason: str, location: tuple[str, int]) -> None:
    """``pytest.skip(reason)``, reported at ``location`` (see the plugin's makereport hook)."""
    import pytest

    exc = pytest.skip.Exception(reason, allow_module_level=False)
    setattr(exc, SKIP_LOCATION_ATTR, location)
    raise exc


def skip_if_every_rank_skipped(info: SpecInfo, failure: RankFailure) -> None:
    """A run whose every failing rank called ``pytest.skip`` is a skip, reported at the body's line."""
    import pytest

    from dstest.errors import WorldAborted

    primary = {r: e for r, e in failure.exceptions.items() if not isinstance(e, WorldAborted)}
    skipped = {r: e for r, e in primary.items() if isinstance(e, pytest.skip.Exception)}
    if skipped and len(skipped) == len(primary):
        rank, first = next(iter(skipped.items()))
        skip(str(first), skip_location(info, first, failure.failures.get(rank)))
