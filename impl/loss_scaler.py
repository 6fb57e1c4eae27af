"""Loss scaling for fp16: static, or dynamic with hysteresis (DeepSpeed's rules and key names)."""

from __future__ import annotations

from typing import Any

from impl.config import FP16Config

__all__ = ["LossScaler", "build_loss_scaler"]


class LossScaler:
    """The current loss scale and its update rule. ``dynamic=False`` keeps ``scale`` fixed.

    Dynamic: an overflow halves the scale (not below ``min_scale``) once ``hysteresis`` overflows have been
    seen; ``window`` consecutive good steps double it.
    """

    def __init__(
        self,
        scale: float,
        *,
        dynamic: bool,
        window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self._hysteresis_left = hysteresis
        self._good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
            return
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= 2
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._good_steps = int(state["good_steps"])


def build_loss_scaler(fp16: FP16Config) -> LossScaler:
    if fp16.loss_scale > 0:
        return LossScaler(fp16.loss_scale, dynamic=False)
    return LossScaler(
        2.0**fp16.initial_scale_power,
        dynamic=True,
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )
