"""ZeRO stages as components of the engine.

A stage is an object built from a :class:`~impl.zero.base.StageContext` (the model after casting and the
initial broadcast, its trainable parameters by name, the data- and model-parallel groups, the validated
config, the :class:`~impl.zero.base.ReductionSettings`, the element-wise optimizer, the compute dtype and
two :class:`~impl.comm.Comm` objects: ``comm`` counts training collectives, ``observer_comm`` does not).
The engine drives it; a stage never touches the loss scale, clipping or the norm.

Interface (what :class:`~impl.engine.Engine` calls, in order, on every rank)::

    stage.stage: int                    # 0, 1, 2, 3
    stage.partitioned: bool             # local_gradients() is a data-parallel partition, so the norm and the
                                        # overflow flag need a reduction over the dp group
    stage.prepare_backward(boundary)    # before loss.backward(); may arm hooks (overlap_comm at the boundary)
    stage.reduce_gradients()            # after backward at the accumulation boundary: every gradient
                                        #   reduced with ReductionSettings (mean: (1/W)·Σ, sum: Σ; B2, B3)
    stage.local_gradients()             # [(param, grad piece)] this rank owns after reduction (norm, overflow)
    stage.step(multiplier)              # multiply owned grads by `multiplier` unless None (C5), update the
                                        #   fp32 master partition, write the full parameters back to the model
    stage.skip_step()                   # overflow: no update
    stage.zero_grad()
    stage.full_parameters() -> {name: fp32 tensor}   # collective at W > 1 (observer_comm): all ranks call
    stage.full_gradients()  -> {name: fp32 tensor}   # reduced, before unscaling; valid between backward, step
    stage.state_bytes() -> {"master_params", "optimizer_state", "gradients", "comm_buffers": bytes}   (B9, A8)
    stage.comm_buffer_bytes() -> int
    stage.state_dict() / stage.load_state_dict(state)   # this rank's share only
    stage.step_count: int               # optimizer steps taken (skipped steps excluded)

Stage 3 (``impl/zero/stage3.py``, class ``Stage3(ctx)``) plugs in here: it partitions parameters in its
constructor and gathers them with forward pre-hooks; :func:`build_stage` finds it when the module exists.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from impl.config import NotSupportedError
from impl.zero.base import FlatStage, ReductionSettings, StageContext
from impl.zero.stage0 import Stage0
from impl.zero.stage12 import Stage12

__all__ = ["FlatStage", "ReductionSettings", "Stage0", "Stage12", "StageContext", "build_stage"]


def build_stage(stage: int, ctx: StageContext) -> Any:
    """The stage component for ``zero_optimization.stage``."""
    if stage == 0:
        return Stage0(ctx)
    if stage in (1, 2):
        return Stage12(ctx, stage)
    if stage == 3 and importlib.util.find_spec("impl.zero.stage3") is not None:
        return importlib.import_module("impl.zero.stage3").Stage3(ctx)
    allowed = [0, 1, 2, 3] if importlib.util.find_spec("impl.zero.stage3") is not None else [0, 1, 2]
    raise NotSupportedError(f"zero_optimization.stage={stage!r} is not available in this impl; allowed: {allowed}")
