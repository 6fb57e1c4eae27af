"""impl.config: DeepSpeed key names, defaults, and every rejection as a clear error at configuration time."""

from __future__ import annotations

import json
from typing import Any

import pytest

import impl
from impl.config import ConfigError, NotSupportedError, parse_config

pytestmark = pytest.mark.cpu


def _zero(**kw: Any) -> dict[str, Any]:
    return {"zero_optimization": kw}


def test_defaults() -> None:
    cfg = parse_config({})
    assert cfg.reduce_op == "mean"
    assert cfg.stage == 0
    assert cfg.zero_optimization.compute_grad_norm is True
    assert cfg.zero_optimization.reduce_scatter and cfg.zero_optimization.contiguous_gradients
    assert cfg.gradient_predivide_factor == 1.0 and cfg.gradient_clipping == 0.0
    assert not cfg.fp16.enabled and not cfg.bf16.enabled


@pytest.mark.parametrize("value,want", [("mean", "mean"), ("MEAN", "mean"), ("Sum", "sum"), ("sUm", "sum")])
def test_reduce_op_case_insensitive(value: str, want: str) -> None:
    assert parse_config({"gradient_allreduce_op": value}).reduce_op == want


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(NotSupportedError, ConfigError)


# (config, words the message must contain, exception type)
REJECTED: list[tuple[str, dict[str, Any], list[str], type[Exception]]] = [
    ("B1-avg", {"gradient_allreduce_op": "avg"}, ["gradient_allreduce_op", "'avg'", "['mean', 'sum']"], ConfigError),
    ("B1-int", {"gradient_allreduce_op": 1}, ["gradient_allreduce_op", "1", "['mean', 'sum']"], ConfigError),
    ("B1-None", {"gradient_allreduce_op": None}, ["gradient_allreduce_op", "None", "['mean', 'sum']"], ConfigError),
    (
        "B3-prescale-sum",
        {"gradient_allreduce_op": "sum", "prescale_gradients": True},
        ["prescale_gradients=True", "'sum'", "allowed"],
        ConfigError,
    ),
    (
        "B3-prescale-ignores-factor",
        {"prescale_gradients": True, "gradient_predivide_factor": 2.0},
        ["gradient_predivide_factor=2.0", "prescale_gradients", "allowed"],
        ConfigError,
    ),
    (
        "B3-factor-zero",
        {"gradient_predivide_factor": 0},
        ["gradient_predivide_factor=0", "greater than 0"],
        ConfigError,
    ),
    (
        "B3-factor-inf",
        {"gradient_predivide_factor": float("inf")},
        ["gradient_predivide_factor=inf", "finite"],
        ConfigError,
    ),
    (
        "B7-zenflow",
        {"gradient_allreduce_op": "sum", **_zero(stage=2, zenflow={"topk_ratio": 0.1})},
        ["gradient_allreduce_op='sum'", "ZenFlow", "zenflow", "allowed"],
        ConfigError,
    ),
    (
        "B7-deepcompile",
        {"gradient_allreduce_op": "SUM", "compile": {"deepcompile": True}},
        ["gradient_allreduce_op='sum'", "compile.deepcompile=True", "allowed"],
        ConfigError,
    ),
    (
        "C1-stage0",
        _zero(stage=0, compute_grad_norm=False),
        ["compute_grad_norm=False", "stage=0", "[1, 2]"],
        ConfigError,
    ),
    (
        "C1-stage3",
        _zero(stage=3, compute_grad_norm=False),
        ["compute_grad_norm=False", "stage=3", "[1, 2]"],
        ConfigError,
    ),
    (
        "C2-clipping",
        {"gradient_clipping": 1.0, **_zero(stage=2, compute_grad_norm=False)},
        ["compute_grad_norm=False", "gradient_clipping=1.0", "allowed"],
        ConfigError,
    ),
    (
        "C2-zenflow",
        _zero(stage=1, compute_grad_norm=False, zenflow={}),
        ["compute_grad_norm=False", "ZenFlow", "zenflow={}"],
        ConfigError,
    ),
    (
        "C2-offload",
        _zero(stage=2, compute_grad_norm=False, offload_optimizer={"device": "cpu"}),
        ["compute_grad_norm=False", "offload_optimizer.device='cpu'"],
        ConfigError,
    ),
    (
        "unknown-top",
        {"gradient_allreduce": "sum"},
        ["gradient_allreduce='sum'", "allowed keys", "gradient_allreduce_op"],
        ConfigError,
    ),
    ("unknown-zero", _zero(stages=2), ["zero_optimization.stages=2", "allowed keys", "'stage'"], ConfigError),
    (
        "unknown-optimizer-param",
        {"optimizer": {"type": "SGD", "params": {"lrr": 1}}},
        ["optimizer.params.lrr=1", "'lr'"],
        ConfigError,
    ),
    ("optimizer-type", {"optimizer": {"type": "Adam"}}, ["optimizer.type='Adam'", "['AdamW', 'SGD']"], ConfigError),
    ("stage-4", _zero(stage=4), ["zero_optimization.stage=4", "less than or equal to 3"], ConfigError),
    ("strict-bool", _zero(stage=1, compute_grad_norm="false"), ["compute_grad_norm='false'", "boolean"], ConfigError),
    (
        "comm-dtype",
        {"communication_data_type": "int8"},
        ["communication_data_type='int8'", "['fp32', 'fp16', 'bf16']"],
        ConfigError,
    ),
    (
        "fp16-and-bf16",
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        ["fp16.enabled", "bf16.enabled"],
        ConfigError,
    ),
    ("reduce-scatter-stage0", _zero(stage=0, reduce_scatter=False), ["reduce_scatter=False", "stage=0"], ConfigError),
    (
        "nesterov",
        {"optimizer": {"type": "SGD", "params": {"nesterov": True}}},
        ["nesterov=True", "momentum"],
        ConfigError,
    ),
    ("zenflow-alone", _zero(stage=2, zenflow={}), ["zenflow={}", "not supported"], NotSupportedError),
    (
        "offload-alone",
        _zero(stage=2, offload_optimizer={"device": "nvme"}),
        ["'nvme'", "not supported"],
        NotSupportedError,
    ),
    (
        "deepcompile-alone",
        {"compile": {"deepcompile": True}},
        ["compile.deepcompile=True", "not supported"],
        NotSupportedError,
    ),
    (
        "sparse-stage1",
        {"sparse_gradients": True, **_zero(stage=1)},
        ["sparse_gradients=True", "stage=1"],
        NotSupportedError,
    ),
]


@pytest.mark.parametrize("cfg,words,exc", [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_rejected(cfg: dict[str, Any], words: list[str], exc: type[Exception]) -> None:
    with pytest.raises(exc) as err:
        parse_config(cfg)
    for word in words:
        assert word in str(err.value), f"{word!r} missing from: {err.value}"


@pytest.mark.parametrize(
    "cfg",
    [
        {"gradient_allreduce_op": "sum", "gradient_predivide_factor": 8.0},
        {"prescale_gradients": True},
        _zero(stage=1, compute_grad_norm=False),
        _zero(stage=2, compute_grad_norm=False, offload_optimizer={"device": "none"}),
        {"gradient_clipping": 1.0, **_zero(stage=2)},
        _zero(stage=2, reduce_bucket_size=5e8, overlap_comm=True, reduce_scatter=False, contiguous_gradients=False),
        {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 2}},
        {"bf16": {"enabled": True}, "communication_data_type": "BF16"},
        {"sparse_gradients": True},
        {"optimizer": {"type": "adamw", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}}},
    ],
)
def test_accepted(cfg: dict[str, Any]) -> None:
    parse_config(cfg)


def test_json_path_and_passthrough(tmp_path: Any) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 2}}))
    cfg = parse_config(str(path))
    assert cfg.reduce_op == "sum" and cfg.stage == 2
    assert parse_config(cfg) is cfg
    with pytest.raises(ConfigError, match="must be a dict"):
        parse_config(42)  # type: ignore[arg-type]


def test_initialize_rejects_before_touching_the_model() -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="gradient_allreduce_op"):
        impl.initialize(model=model, config={"gradient_allreduce_op": "avg"})
    with pytest.raises(ConfigError, match="optimizer=None"):
        impl.initialize(model=model, config={})
    with pytest.raises(ConfigError, match="train_batch_size=3"):
        impl.initialize(
            model=model,
            config={"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD"}},
        )
