"""What every model config dataclass shares: built from whatever a user or Hydra passes.

:class:`GPTConfig`, :class:`MoEConfig` and :class:`MoDConfig` come as an instance, a plain or
OmegaConf mapping (from YAML), ``None`` (the defaults) or, where the config has presets, a
preset name; :meth:`ModelConfig.from_any` turns each into a fresh instance and names unknown keys.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = ["ModelConfig"]


class ModelConfig:
    """Mixin for a config dataclass; ``argument`` is how error messages name what was passed."""

    argument: ClassVar[str] = "config"

    @classmethod
    def from_any(cls, config: Any = None):
        """A copy of a config, one built from a mapping, from a preset name (when the class has
        ``preset``), or the defaults for ``None``."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return dataclasses.replace(config)
        presets = callable(getattr(cls, "preset", None))
        if presets and isinstance(config, str):
            return cls.preset(config)
        if isinstance(config, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(config) - fields
            if unknown:
                raise ValueError(f"unknown {cls.__name__} keys {sorted(unknown)}; valid: {sorted(fields)}")
            return cls(**{k: config[k] for k in config})
        accepted = f"a {cls.__name__}, a dict{', a preset name' if presets else ''} or None"
        raise TypeError(f"{cls.argument} must be {accepted}, got {type(config).__name__}")

    def to_dict(self) -> dict:
        """Plain values (tuples become lists) so checkpoints and hparams.yaml stay portable."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
