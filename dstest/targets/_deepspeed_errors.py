"""What the DeepSpeed adapter raises, and its one import of DeepSpeed (:mod:`dstest.targets.deepspeed`).

:func:`crash_is_deviation` tells DeepSpeed's crashes (an exception raised inside DeepSpeed's own files while
serving a call the contract says must work) from its documented rejections and from the adapter's own bugs;
the adapter's files are named ``_deepspeed_*.py`` beside ``deepspeed.py``, never in a ``deepspeed/``
directory, so that a frame of the adapter is never taken for one of DeepSpeed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from dstest.errors import Deviation, DstestError

__all__ = ["DeepSpeedAdapterError", "DeepSpeedDeviation", "DeepSpeedUnavailable", "crash_is_deviation", "import_deepspeed"]


class DeepSpeedUnavailable(DstestError, ImportError):
    """DeepSpeed is not installed (or cannot be imported) in this environment."""


class DeepSpeedAdapterError(DstestError, RuntimeError):
    """The adapter cannot serve the request (wrong world, no process group, an optimizer it does not build).

    Not a ValueError or AssertionError on purpose: the conformance run must report these as failures of the
    run, never as deviations of DeepSpeed."""


def import_deepspeed() -> Any:
    """Import DeepSpeed for CPU where no GPU is present (``DS_ACCELERATOR=cpu`` unless set)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
    except ImportError as exc:
        raise DeepSpeedUnavailable(
            f"target 'deepspeed' needs DeepSpeed, which cannot be imported here ({type(exc).__name__}: {exc}); "
            "install it with `pip install dstest[deepspeed]` (on CPU also set DS_ACCELERATOR=cpu)"
        ) from exc
    return deepspeed


class DeepSpeedDeviation(Deviation):
    """A :class:`~dstest.errors.Deviation` found by the DeepSpeed adapter (pickles across processes)."""


@contextlib.contextmanager
def crash_is_deviation(contract: str, expected: str) -> Iterator[None]:
    """Report an exception that DeepSpeed's own code raises (a crash such as a negative tensor size, not
    an assertion or a documented ValueError) while serving a call the contract says must work, as a
    :class:`~dstest.errors.Deviation` of ``contract``; the original stays chained as its cause."""
    try:
        yield
    except (AssertionError, ValueError, TypeError, NotImplementedError, DstestError):
        raise
    except Exception as exc:
        config_module = sys.modules.get("deepspeed.runtime.config")
        if config_module is not None and isinstance(exc, config_module.DeepSpeedConfigError):
            raise  # a rejected configuration (one of the target's config_errors), not a crash
        inside = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}deepspeed{os.sep}" in f.filename]
        if not inside:
            raise
        inner = inside[-1]  # DeepSpeed's innermost frame (the crash may surface in torch below it)
        where = f"{inner.filename.rsplit(os.sep + 'site-packages' + os.sep, 1)[-1]}:{inner.lineno} in {inner.name}"
        raise DeepSpeedDeviation(
            contract, expected, f"{type(exc).__name__}: {exc}", f"raised inside DeepSpeed at {where}"
        ) from exc
