"""The public namespace is exactly __all__ (STYLE: as Hypothesis checks its strategies module)."""

from __future__ import annotations

import pytest

import dstest

pytestmark = pytest.mark.cpu


def test_all_is_the_public_namespace() -> None:
    public = {name for name in dir(dstest) if not name.startswith("_")}
    assert public == set(dstest.__all__)
    for name in dstest.__all__:
        assert getattr(dstest, name) is not None


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dstest.nope  # noqa: B018


def test_spec_arguments_are_validated() -> None:
    with pytest.raises(dstest.InvalidArgument, match="each size must be an int >= 1, got 0"):
        dstest.spec(world_size=[2, 0])
    with pytest.raises(dstest.InvalidArgument, match="unknown \\['gloo'\\]"):
        dstest.spec(worlds=["gloo"])
