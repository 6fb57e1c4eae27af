"""Validated configuration with DeepSpeed's key names (for the subset impl implements).

:func:`parse_config` turns a dict (or a JSON file path, or a :class:`Config`) into a frozen :class:`Config`.
Every problem is a :class:`ConfigError` (a ``ValueError``) raised here, at configuration time, before
``impl.initialize`` issues any collective; the message names the setting, the value received (its repr)
and what is allowed. Settings that impl accepts only so that their specific conflicts can be reported
(``zero_optimization.offload_optimizer``, ``zero_optimization.zenflow``, ``compile.deepcompile``) raise
:class:`NotSupportedError` (a ``ConfigError``) when enabled in any other combination.

Rejected combinations (contract numbers, docs/contracts.md):

======  ===========================================================================================
B1      ``gradient_allreduce_op`` not one of "mean", "sum" (compared case-insensitively)
B3      ``prescale_gradients`` with "sum"; ``prescale_gradients`` with ``gradient_predivide_factor`` != 1
        (prescaling divides by the world size, so the factor would be silently ignored)
B7      "sum" with ZenFlow; "sum" with a compiled (DeepCompile) reduction path
C1      ``zero_optimization.compute_grad_norm`` false at a stage other than 1 or 2 (names the stage)
C2      ``compute_grad_norm`` false with ``gradient_clipping`` > 0, with ZenFlow, with optimizer offload
======  ===========================================================================================
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

__all__ = [
    "COMM_DTYPES",
    "OPTIMIZERS",
    "REDUCE_OPS",
    "BF16Config",
    "CompileConfig",
    "Config",
    "ConfigError",
    "FP16Config",
    "NotSupportedError",
    "OffloadOptimizerConfig",
    "OptimizerConfig",
    "ZeroConfig",
    "parse_config",
]

REDUCE_OPS = ("mean", "sum")
OPTIMIZERS = ("AdamW", "SGD")
COMM_DTYPES = ("fp32", "fp16", "bf16")
_COMM_ALIASES = MappingProxyType({
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
})  # fmt: skip


class ConfigError(ValueError):
    """An invalid impl configuration; the message names the setting, the value (repr) and what is allowed."""


class NotSupportedError(ConfigError):
    """A DeepSpeed setting impl recognises but does not implement (offload, ZenFlow, DeepCompile, ...)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FP16Config(_Model):
    enabled: StrictBool = False
    loss_scale: Annotated[float, Field(ge=0.0)] = 0.0
    """0 means dynamic loss scaling; any other value is a static scale."""
    initial_scale_power: Annotated[int, Field(ge=0, le=63)] = 16
    loss_scale_window: Annotated[int, Field(ge=1)] = 1000
    hysteresis: Annotated[int, Field(ge=1)] = 2
    consecutive_hysteresis: StrictBool = False
    min_loss_scale: Annotated[float, Field(gt=0.0)] = 1.0


class BF16Config(_Model):
    enabled: StrictBool = False


class AdamWParams(_Model):
    lr: Annotated[float, Field(ge=0.0)] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0.0)] = 1e-8
    weight_decay: Annotated[float, Field(ge=0.0)] = 1e-2


class SGDParams(_Model):
    lr: Annotated[float, Field(ge=0.0)] = 1e-3
    momentum: Annotated[float, Field(ge=0.0)] = 0.0
    dampening: float = 0.0
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    nesterov: StrictBool = False


class OptimizerConfig(_Model):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> str:
        names = {n.lower(): n for n in OPTIMIZERS}
        if not isinstance(value, str) or value.lower() not in names:
            raise ValueError(f"optimizer.type={value!r} is not supported; allowed: {list(OPTIMIZERS)}")
        return names[value.lower()]

    @model_validator(mode="after")
    def _known_params(self) -> OptimizerConfig:
        model = AdamWParams if self.type == "AdamW" else SGDParams
        try:
            model.model_validate(self.params)
        except ValidationError as exc:
            raise ValueError(_messages(exc, model, prefix=("optimizer", "params"))) from None
        if self.type == "SGD":
            sgd = SGDParams.model_validate(self.params)
            if sgd.nesterov and (sgd.momentum <= 0 or sgd.dampening != 0):
                raise ValueError(
                    f"optimizer.params.nesterov=True needs momentum > 0 and dampening == 0, got "
                    f"momentum={sgd.momentum!r}, dampening={sgd.dampening!r}"
                )
        return self

    def hyperparameters(self) -> AdamWParams | SGDParams:
        model = AdamWParams if self.type == "AdamW" else SGDParams
        return model.model_validate(self.params)


class OffloadOptimizerConfig(_Model):
    device: Literal["none", "cpu", "nvme"] = "none"
    pin_memory: StrictBool = False
    nvme_path: str | None = None
    buffer_count: Annotated[int, Field(ge=1)] = 4
    fast_init: StrictBool = False
    ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0

    @property
    def enabled(self) -> bool:
        return self.device != "none"


class ZeroConfig(_Model):
    stage: Annotated[int, Field(ge=0, le=3)] = 0
    reduce_scatter: StrictBool = True
    contiguous_gradients: StrictBool = True
    overlap_comm: StrictBool = False
    reduce_bucket_size: Annotated[int, Field(ge=1)] = 500_000_000
    compute_grad_norm: StrictBool = True
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: dict[str, Any] | None = None
    """ZenFlow's own keys are not validated: impl implements no ZenFlow; its presence enables it."""

    @field_validator("reduce_bucket_size", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        # DeepSpeed configs often write sizes as floats (5e8); accept integral floats only.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @property
    def offload_enabled(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.enabled

    @property
    def zenflow_enabled(self) -> bool:
        return self.zenflow is not None


class CompileConfig(_Model):
    deepcompile: StrictBool = False


class Config(_Model):
    """The whole configuration. Field names are DeepSpeed's; see the module docstring for rejections."""

    train_batch_size: Annotated[int | None, Field(ge=1)] = None
    train_micro_batch_size_per_gpu: Annotated[int | None, Field(ge=1)] = None
    gradient_accumulation_steps: Annotated[int, Field(ge=1)] = 1
    gradient_clipping: Annotated[float, Field(ge=0.0)] = 0.0
    gradient_allreduce_op: str = "mean"
    gradient_predivide_factor: Annotated[float, Field(gt=0.0)] = 1.0
    prescale_gradients: StrictBool = False
    communication_data_type: str | None = None
    sparse_gradients: StrictBool = False
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    optimizer: OptimizerConfig | None = None
    zero_optimization: ZeroConfig = ZeroConfig()
    compile: CompileConfig = CompileConfig()

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _reduce_op(cls, value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in REDUCE_OPS:
            raise ValueError(f"gradient_allreduce_op={value!r} is not allowed; allowed: {list(REDUCE_OPS)}")
        return value.lower()

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _comm_dtype(cls, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or value.lower() not in _COMM_ALIASES:
            raise ValueError(f"communication_data_type={value!r} is not allowed; allowed: {list(COMM_DTYPES)} or null")
        return _COMM_ALIASES[value.lower()]

    @field_validator("gradient_predivide_factor", "gradient_clipping")
    @classmethod
    def _finite(cls, value: float, info: Any) -> float:
        if not math.isfinite(value):
            raise ValueError(f"{info.field_name}={value!r} must be a finite number")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        zero = self.zero_optimization
        op = self.gradient_allreduce_op
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled=True and bf16.enabled=True: allowed is at most one of them")
        # B7: rejected before anything else about these features, so the specific reason is reported.
        if op == "sum" and zero.zenflow_enabled:
            raise ValueError(
                f"gradient_allreduce_op='sum' cannot be combined with ZenFlow "
                f"(zero_optimization.zenflow={zero.zenflow!r}); allowed: gradient_allreduce_op='mean' with ZenFlow"
            )
        if op == "sum" and self.compile.deepcompile:
            raise ValueError(
                "gradient_allreduce_op='sum' cannot be combined with a compiled reduction path "
                "(compile.deepcompile=True); allowed: gradient_allreduce_op='mean' with compile.deepcompile"
            )
        # B3
        if self.prescale_gradients and op == "sum":
            raise ValueError(
                "prescale_gradients=True has no meaning with gradient_allreduce_op='sum' (prescaling divides by "
                "the world size before the reduction); allowed: prescale_gradients=False with 'sum'"
            )
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            raise ValueError(
                f"gradient_predivide_factor={self.gradient_predivide_factor!r} would be ignored with "
                "prescale_gradients=True (which divides by the world size before the reduction); "
                "allowed: gradient_predivide_factor=1.0 with prescale_gradients, or prescale_gradients=False"
            )
        # C1, C2
        if not zero.compute_grad_norm:
            if zero.stage not in (1, 2):
                raise ValueError(
                    f"zero_optimization.compute_grad_norm=False is not allowed at zero_optimization.stage="
                    f"{zero.stage!r}; allowed: compute_grad_norm=False only at stages [1, 2]"
                )
            if self.gradient_clipping > 0:
                raise ValueError(
                    f"zero_optimization.compute_grad_norm=False cannot be combined with gradient_clipping="
                    f"{self.gradient_clipping!r} (clipping needs the gradient norm); allowed: gradient_clipping=0"
                    " with compute_grad_norm=False"
                )
            if zero.zenflow_enabled:
                raise ValueError(
                    f"zero_optimization.compute_grad_norm=False cannot be combined with ZenFlow "
                    f"(zero_optimization.zenflow={zero.zenflow!r}); allowed: compute_grad_norm=True with ZenFlow"
                )
            if zero.offload_enabled:
                assert zero.offload_optimizer is not None
                raise ValueError(
                    f"zero_optimization.compute_grad_norm=False cannot be combined with optimizer offload "
                    f"(zero_optimization.offload_optimizer.device={zero.offload_optimizer.device!r}); "
                    "allowed: offload_optimizer.device='none' with compute_grad_norm=False"
                )
        if "reduce_scatter" in zero.model_fields_set and zero.stage == 0:
            raise ValueError(
                f"zero_optimization.reduce_scatter={zero.reduce_scatter!r} has no effect at zero_optimization.stage=0 "
                "(stage 0 all-reduces); allowed: leave reduce_scatter unset at stage 0, or use stage 1 or 2"
            )
        return self

    # -- derived values ---------------------------------------------------------------------------
    @property
    def reduce_op(self) -> str:
        return self.gradient_allreduce_op

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage


def _not_supported(config: Config) -> None:
    zero = config.zero_optimization
    unsupported: list[str] = []
    if zero.zenflow_enabled:
        unsupported.append(f"zero_optimization.zenflow={zero.zenflow!r}")
    if zero.offload_enabled:
        assert zero.offload_optimizer is not None
        unsupported.append(f"zero_optimization.offload_optimizer.device={zero.offload_optimizer.device!r}")
    if config.compile.deepcompile:
        unsupported.append("compile.deepcompile=True")
    if config.sparse_gradients and zero.stage != 0:
        unsupported.append(f"sparse_gradients=True at zero_optimization.stage={zero.stage!r}")
    if unsupported:
        raise NotSupportedError(
            f"{'; '.join(unsupported)}: not supported by impl; allowed: offload_optimizer.device='none', no "
            "zenflow, compile.deepcompile=False, sparse_gradients=True only at stage 0"
        )


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys allowed at ``loc`` (the path of an unknown key, without the key itself)."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        for arg in (ann, *getattr(ann, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
                break
        else:
            return None
    return sorted(current.model_fields)


def _messages(exc: ValidationError, model: type[BaseModel], prefix: tuple[Any, ...] = ()) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if isinstance(p, str))
        path = ".".join(str(p) for p in (*prefix, *loc))
        value = err.get("input")
        if err["type"] == "value_error":
            lines.append(str(err["ctx"]["error"]))
        elif err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1])
            lines.append(f"unknown setting {path}={value!r}; allowed keys here: {allowed}")
        else:
            lines.append(f"{path}={value!r}: {err['msg']}")
    return "; ".join(lines)


def parse_config(config: Mapping[str, Any] | Config | str | os.PathLike[str]) -> Config:
    """Validate ``config`` (a dict, a :class:`Config`, or the path of a JSON file); raises :class:`ConfigError`."""
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise ConfigError(f"config={config!r} must be a dict, a JSON file path or an impl.config.Config")
    try:
        parsed = Config.model_validate(dict(config))
    except ValidationError as exc:
        raise ConfigError(_messages(exc, Config)) from None
    _not_supported(parsed)
    return parsed
