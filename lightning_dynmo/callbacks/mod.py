"""``MixtureOfDepths``: anneals MoD capacity, logs per-block token fractions, and asks a pipeline
strategy to rebalance when the per-block load profile shifts.

A strategy that reads each block's :class:`~lightning_dynmo.protocol.ReportsLoad` factor every
step can rescale its costs without help; the request is what makes it re-profile, and what a
strategy that rebalances only on request needs. The callback keeps its own counters on the
blocks (``tokens_*``), separate from the load window the strategy resets after every step.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ._pipeline_access import (all_reduce_over_pipeline, local_layers, pipeline_layers, pipeline_of,
    pipeline_reduce_group, reduce_device)
from ..models.mod import MoDBlock, check_capacity
from ..protocol import PipelineControl

ANNEALS = ("linear", "cosine")


class MixtureOfDepths(Callback):
    """Drives the :class:`~lightning_dynmo.models.mod.MoDBlock` layers of a model such as
    :class:`~lightning_dynmo.models.mod.MoDGPT`.

    Args:
        capacity: capacity set at step 0 (``None``: keep the model's configured capacity and
            schedule nothing).
        final_capacity: capacity reached at ``anneal_steps`` and kept afterwards (``None``: no
            schedule, ``capacity`` throughout).
        anneal_steps: length of the schedule in optimizer steps.
        anneal: ``"linear"`` or ``"cosine"`` (half cosine from ``capacity`` to ``final_capacity``).
        drift: request a rebalance when any block's load (computed fraction of its tokens)
            differs by more than this from its value at the last request. The baseline before
            the first request is 1.0 (full blocks), what a partition made without MoD assumes.
        check_interval: measure every this many steps (one all-reduce of ``4 x num_layers``
            numbers over the pipeline, and over data-parallel replicas so that every rank
            decides the same).

    Logs ``mod/capacity`` (the scheduled capacity), ``mod/capacity_L{i}`` (fraction of tokens
    block ``i`` took), ``mod/load_L{i}`` (fraction it computed, padding included) and
    ``mod/predictor_accuracy`` (predictor routing only: agreement with the top-k targets) and
    ``mod/predictor_threshold_L{i}`` (predictor routing only: the logit threshold block ``i``
    used in this step; the model calibrates it after the callbacks' batch-end hooks).
    """

    def __init__(self, capacity: float | None = None, final_capacity: float | None = None, anneal_steps: int = 0,
                 anneal: str = "linear", drift: float = 0.1, check_interval: int = 1) -> None:
        if final_capacity is not None and capacity is None:
            raise ValueError("MixtureOfDepths final_capacity needs a start: pass capacity as well")
        self.capacity = None if capacity is None else check_capacity(capacity)
        self.final_capacity = None if final_capacity is None else check_capacity(final_capacity)
        if final_capacity is not None and int(anneal_steps) < 1:
            raise ValueError(f"MixtureOfDepths anneal_steps must be >= 1 to reach final_capacity, got {anneal_steps}")
        if anneal not in ANNEALS:
            raise ValueError(f"unknown MixtureOfDepths anneal {anneal!r}; use one of {', '.join(ANNEALS)}")
        if not drift > 0:
            raise ValueError(f"MixtureOfDepths drift must be > 0, got {drift}")
        if int(check_interval) < 1:
            raise ValueError(f"MixtureOfDepths check_interval must be >= 1, got {check_interval}")
        self.anneal_steps = int(anneal_steps)
        self.anneal = anneal
        self.drift = float(drift)
        self.check_interval = int(check_interval)
        self.baseline: list[float] | None = None  # loads at the last request
        self.last_loads: list[float] | None = None
        self.last_fractions: list[float] | None = None
        self.predictor_accuracy: float | None = None
        self.last_thresholds: list[float] | None = None  # per layer, NaN without a predictor
        self.requests: list[dict] = []

    def capacity_at(self, step: int) -> float | None:
        if self.final_capacity is None:
            return self.capacity
        t = min(1.0, max(0, step) / self.anneal_steps)
        c0, c1 = self.capacity, self.final_capacity
        if self.anneal == "cosine":
            return c1 + (c0 - c1) * 0.5 * (1.0 + math.cos(math.pi * t))
        return c0 + (c1 - c0) * t

    @staticmethod
    def _blocks(pl_module) -> list[tuple[int, MoDBlock]]:
        return [(i, l) for i, l in local_layers(pl_module) if isinstance(l, MoDBlock)]

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self._blocks(pl_module):
            raise TypeError(
                "MixtureOfDepths needs a model whose pipeline layers include MoDBlock layers (the token-packing "
                f"path), e.g. lightning_dynmo.models.MoDGPT; got {type(pl_module).__name__}"
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        cap = self.capacity_at(trainer.global_step)
        if cap is None:
            return
        for _, block in self._blocks(pl_module):
            block.capacity = cap
        pl_module.log("mod/capacity", cap, on_step=True, on_epoch=False, batch_size=1)

    def measure(self, trainer, pl_module) -> tuple[list[float], list[float], float | None]:
        """Per layer, since the last measurement: the fraction of tokens taken and the fraction
        computed (NaN for non-MoD layers), and the predictor accuracy (``None`` without a
        predictor). Resets the block counters. Collective under a pipeline strategy. Also sets
        ``last_thresholds`` (per layer, the predictor threshold in force; NaN without one)."""
        L = len(pipeline_layers(pl_module))
        # rows: tokens seen, taken, computed, predictor agreements, tokens seen by a predictor,
        # predictor threshold, blocks with a predictor (replicas agree on the threshold: / count)
        counts = torch.zeros(7, L, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        for i, b in self._blocks(pl_module):
            has = b.predictor is not None
            counts[:, i] = torch.tensor([b.tokens_seen, b.tokens_routed, b.tokens_computed, b.predictor_agree,
                                         b.tokens_seen if has else 0, float(b.predictor_threshold) if has else 0.0,
                                         1.0 if has else 0.0], dtype=torch.float64)
            b.reset_counters()
        counts = all_reduce_over_pipeline(trainer, counts)
        dp_group = getattr(pipeline_of(trainer), "data_parallel_group", None)
        if pipeline_reduce_group(trainer)[0] and dp_group is not None:
            dist.all_reduce(counts, group=dp_group)  # replicas saw different data: decide alike
        seen, taken, computed, agree, predicted, threshold, holders = counts.cpu().tolist()
        self.last_thresholds = [threshold[i] / holders[i] if holders[i] > 0 else math.nan for i in range(L)]
        frac = [taken[i] / seen[i] if seen[i] > 0 else math.nan for i in range(L)]
        load = [computed[i] / seen[i] if seen[i] > 0 else math.nan for i in range(L)]
        acc = sum(agree) / sum(predicted) if sum(predicted) > 0 else None
        return frac, load, acc

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.check_interval:
            return
        frac, load, acc = self.measure(trainer, pl_module)
        self.last_fractions, self.last_loads, self.predictor_accuracy = frac, load, acc
        blocks = [i for i, f in enumerate(frac) if not math.isnan(f)]
        for i in blocks:
            pl_module.log(f"mod/capacity_L{i}", frac[i], on_step=True, on_epoch=False, batch_size=1)
            pl_module.log(f"mod/load_L{i}", load[i], on_step=True, on_epoch=False, batch_size=1)
            if not math.isnan(self.last_thresholds[i]):
                pl_module.log(f"mod/predictor_threshold_L{i}", self.last_thresholds[i], on_step=True, on_epoch=False,
                              batch_size=1)
        if acc is not None:
            pl_module.log("mod/predictor_accuracy", acc, on_step=True, on_epoch=False, batch_size=1)
        if not blocks or not isinstance(pipeline_of(trainer), PipelineControl):
            return
        base = self.baseline if self.baseline is not None and len(self.baseline) == len(load) else [1.0] * len(load)
        worst = max(blocks, key=lambda i: abs(load[i] - base[i]))
        if abs(load[worst] - base[worst]) > self.drift:
            reason = f"mod: load of layer {worst} moved {base[worst]:.2f} -> {load[worst]:.2f}"
            pipeline_of(trainer).request_rebalance(reason, reprofile=False)  # routing changed, not structure
            self.baseline = [1.0 if math.isnan(f) else f for f in load]
            self.requests.append({"step": int(trainer.global_step), "reason": reason})

    def state_dict(self) -> dict[str, Any]:
        # the schedule is configuration: the capacity in force follows the restored step
        return {"baseline": self.baseline, "last_loads": self.last_loads, "last_fractions": self.last_fractions,
                "predictor_accuracy": self.predictor_accuracy, "last_thresholds": self.last_thresholds,
                "requests": list(self.requests)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline = state_dict.get("baseline")
        self.last_loads = state_dict.get("last_loads")
        self.last_fractions = state_dict.get("last_fractions")
        self.predictor_accuracy = state_dict.get("predictor_accuracy")
        self.last_thresholds = state_dict.get("last_thresholds")
        self.requests = list(state_dict.get("requests", []))
