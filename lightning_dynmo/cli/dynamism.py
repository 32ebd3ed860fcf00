"""The ``dynamism`` config group of the GPT recipe: which model class and which callbacks.

``conf/dynamism/<name>.yaml`` holds ``name``, ``model_class`` (import path), ``model_kwargs``
(extra constructor arguments: ``moe``, ``mod``, ``exit_layers`` ...) and ``callbacks`` (a mapping
name -> ``{_target_: callback class, arguments}``, so a single argument is overridable:
``dynamism.callbacks.pruning.final_sparsity=0.8``). ``recipes/train_gpt.py`` calls
:func:`model_class` and :func:`build_callbacks`; a config without a ``dynamism`` node means
``none``.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("train_gpt")
KEYS = ("name", "model_class", "model_kwargs", "callbacks")


def _node(cfg: DictConfig) -> dict:
    node = cfg.get("dynamism")
    if node is None:
        return {"name": "none", "model_class": "lightning_dynmo.models.GPT", "model_kwargs": {}, "callbacks": {}}
    d = OmegaConf.to_container(node, resolve=True)
    unknown = sorted(set(d) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown dynamism key(s) {unknown}; a dynamism config has {', '.join(KEYS)}")
    return d


def _import(path: str) -> Any:
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"dynamism: cannot import {path!r} ({err})") from None


def model_class(cfg: DictConfig) -> tuple[type, dict]:
    """``(class, extra keyword arguments)`` of the model this dynamism trains."""
    d = _node(cfg)
    cls = _import(d.get("model_class") or "lightning_dynmo.models.GPT")
    return cls, dict(d.get("model_kwargs") or {})


def build_callbacks(cfg: DictConfig) -> list:
    """The dynamism's Lightning callbacks (instantiated; bad arguments raise here, before any
    rank starts). Logs what runs, and says so when the strategy would ignore the callbacks'
    rebalance requests (``strategy.rebalance=never``)."""
    from hydra.utils import instantiate

    d = _node(cfg)
    callbacks = []
    for name, spec in (d.get("callbacks") or {}).items():
        if spec is None:  # dynamism.callbacks.<name>=null drops one
            continue
        if "_target_" not in spec:
            raise ValueError(f"dynamism.callbacks.{name} needs a _target_ (the callback class)")
        callbacks.append(instantiate(spec, _convert_="all"))
    if callbacks:
        s = cfg.get("strategy") or {}
        rebalance = s.get("rebalance") if s.get("_target_") else None
        log.info("dynamism=%s: %s with %s", d.get("name"), d.get("model_class"),
                 ", ".join(type(c).__name__ for c in callbacks))
        if rebalance == "never":
            log.warning("dynamism=%s asks for rebalances but strategy.rebalance=never keeps the partition static "
                        "(use strategy.rebalance=on_event or auto for DynMo)", d.get("name"))
    return callbacks
