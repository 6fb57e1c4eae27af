"""impl: a compact data-parallel (ZeRO-style) training runtime with DeepSpeed's configuration keys.

``impl.initialize(model=..., config=..., dp_group=None, mp_group=None)`` returns an :class:`Engine`.
Nothing here keeps module-level mutable state: everything hangs off the engine, so ranks can be threads.
"""

from __future__ import annotations

from impl.config import Config, ConfigError, NotSupportedError, parse_config
from impl.engine import CheckpointError, Engine, initialize

__all__ = ["CheckpointError", "Config", "ConfigError", "Engine", "NotSupportedError", "initialize", "parse_config"]
