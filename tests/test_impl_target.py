"""dstest.targets: the Target / TrainingEngine protocols and the impl adapter."""

from __future__ import annotations

import pytest
import torch

import impl
from dstest.conformance import build, config
from dstest.errors import DstestError, InvalidArgument, UnknownFeature
from dstest.targets import FEATURES, Target, TrainingEngine, get_target, require

pytestmark = pytest.mark.cpu


def test_impl_target_satisfies_the_protocols() -> None:
    target = get_target("impl")
    assert isinstance(target, Target)
    assert target.name == "impl" and target.third_party is False
    engine = target.initialize(build(), config(1))
    assert isinstance(engine, TrainingEngine)
    assert isinstance(engine, impl.Engine)
    assert target.config_errors == (impl.ConfigError,)


def test_features() -> None:
    target = get_target("impl")
    for feature in FEATURES - {"stage3"}:
        assert target.supports(feature), feature
    assert not target.supports("no-such-feature")
    import importlib.util

    assert target.supports("stage3") is (importlib.util.find_spec("impl.zero.stage3") is not None)


def test_require_skips_and_validates() -> None:
    target = get_target("impl")
    require(target, "stage0", "compute_grad_norm")
    with pytest.raises(UnknownFeature, match="unknown feature") as err:
        require(target, "stage7")
    assert isinstance(err.value, DstestError) and isinstance(err.value, ValueError), (
        "in the hierarchy, still a ValueError"
    )

    class Bare:
        name = "bare"

        def supports(self, feature: str) -> bool:
            return False

    with pytest.raises(pytest.skip.Exception, match="does not support"):
        require(Bare(), "stage0")  # type: ignore[arg-type]


def test_unknown_target() -> None:
    with pytest.raises(InvalidArgument, match="allowed: \\['impl'"):
        get_target("torchrun")


def test_helpers_without_a_group() -> None:
    target = get_target("impl")
    assert target.is_parallel(None) is False
    t = torch.ones(3)
    assert target.all_reduce(t, None) is t
    with pytest.raises(impl.ConfigError):
        target.check_config({"gradient_allreduce_op": "avg"})
