"""The Hydra structured config of ``DynMoStrategy``, made from :class:`PipelineOptions` so that
the recipe's ``strategy.*`` keys, their types and their defaults are the dataclass's own.

``import lightning_dynmo`` registers it as ``dynmo_options``; ``conf/strategy/dynmo.yaml``
extends it with the recipe's overrides only. OmegaConf types what it can hold (int, float, bool,
str, Optional of one of them); the mode enums are typed ``str`` (OmegaConf would want the members'
upper-case names, the dataclass takes the values users write), and an option that also takes a
list or one of several kinds (``pipeline_parallel``: an int or ``"auto"``) is typed ``Any``; the
dataclass checks every value when the recipe instantiates the strategy.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any, Literal, Optional

from hydra.core.config_store import ConfigStore

from .options import PipelineOptions

TARGET = "lightning_dynmo.DynMoStrategy"
PRIMITIVES = (int, float, bool, str)


def config_type(hint) -> Any:
    """The OmegaConf type of one option's annotation. Plain classes other than primitives and
    enums (``ScheduleSpec``, ``Partition``, ``timedelta``) are the normalised forms the dataclass
    produces, not what a config holds, so they are left out."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds, optional = set(), False
    for a in args:
        if a is type(None):
            optional = True
        elif typing.get_origin(a) is Literal:
            kinds.update(type(v) for v in typing.get_args(a))
        elif isinstance(a, type) and issubclass(a, Enum):
            kinds.add(str)
        elif a in PRIMITIVES:
            kinds.add(a)
        elif typing.get_origin(a) is not None:  # tuple[...], list[...]: a config holds a list
            return Any
    if len(kinds) != 1:
        return Any
    (kind,) = kinds
    return Optional[kind] if optional else kind


def structured_config() -> type:
    """A dataclass with ``_target_`` and every option, at the option's default."""
    hints = typing.get_type_hints(PipelineOptions)
    specs: list[tuple] = [("_target_", str, dataclasses.field(default=TARGET))]
    for f in dataclasses.fields(PipelineOptions):
        default = f.default.value if isinstance(f.default, Enum) else f.default
        specs.append((f.name, config_type(hints[f.name]), dataclasses.field(default=default)))
    return dataclasses.make_dataclass("DynMoStrategyConfig", specs)


def register_strategy_config(name: str = "dynmo_options") -> None:
    """Store the structured config in Hydra's ConfigStore (idempotent), outside any config group so
    that it is no choice of the `strategy` group; `conf/strategy/dynmo.yaml` extends it."""
    ConfigStore.instance().store(name=name, node=structured_config())
