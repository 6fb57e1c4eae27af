"""The adapter for impl (this repository's runtime): thin, since impl was built to the specs' shape."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dstest.targets.base import FEATURES, TrainingEngine

__all__ = ["ImplTarget"]


class ImplTarget:
    name = "impl"
    third_party = False
    default_world = "threaded"

    def __init__(self) -> None:
        from impl.config import ConfigError

        self.config_errors: tuple[type[BaseException], ...] = (ConfigError,)
        self._features = FEATURES - {"stage3"}

    @staticmethod
    def prepare(device: str) -> None:
        """Build impl's native ops before the first spec's timeout starts (see
        :meth:`dstest.binding.TargetBinding.prepare`): impl's ZeRO-3 gatherer compacts with them, and they are
        JIT-built on first use, 30 s to 2 min on two cores (cached in ``impl.ops._build.extension_dir()``).
        Once built, nothing is done here: a rank's load then only checks the build, in about a second. A
        build that fails is said here and left to the specs that use the ops, which fail with its error."""
        from impl.ops import _build

        if _build.is_built():
            return
        print(
            f"dstest: building impl's native ops (first run on this machine: 30 s to 2 min on 2 cores) in "
            f"{_build.extension_dir()} ...",
            file=sys.stderr,
            flush=True,
        )
        start = time.monotonic()
        try:
            _build.load_extension()
        except _build.ExtensionBuildError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(
                f"dstest: impl's native ops were not built ({first[:300]}); the specs that use them fail with "
                "the whole error",
                file=sys.stderr,
                flush=True,
            )
            return
        print(f"dstest: built impl's native ops in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    def supports(self, feature: str) -> bool:
        if feature == "stage3":
            import importlib.util

            return importlib.util.find_spec("impl.zero.stage3") is not None
        return feature in self._features

    def check_config(self, config: Mapping[str, Any]) -> None:
        from impl.config import parse_config

        parse_config(config)

    def initialize(
        self, model: torch.nn.Module, config: Mapping[str, Any], dp_group: Any = None, mp_group: Any = None
    ) -> TrainingEngine:
        import impl

        return impl.initialize(model=model, config=config, dp_group=dp_group, mp_group=mp_group)

    def is_parallel(self, group: Any) -> bool:
        from impl.comm.pg_utils import is_parallel

        return is_parallel(group)

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        from impl.comm.collectives import all_reduce

        return all_reduce(tensor, group, op)

    def column_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        from impl.parallel import ColumnParallelLinear

        return ColumnParallelLinear(weight, bias, group)

    def row_parallel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> torch.nn.Module:
        from impl.parallel import RowParallelLinear

        return RowParallelLinear(weight, bias, group)

    def vocab_parallel_cross_entropy(
        self, logits: torch.Tensor, target: torch.Tensor, group: Any, vocab_start: int
    ) -> torch.Tensor:
        from impl.parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, target, group, vocab_start)

    def global_norm(self, tensors: Iterable[torch.Tensor], mp_group: Any) -> torch.Tensor:
        from impl.parallel import global_norm

        return global_norm(tensors, mp_group)
