"""Evaluation metrics beyond the loss: the module's ``pipeline_eval_step`` on the last stage.

Under the pipeline ``validation_step``/``test_step`` are not called (no rank holds the whole
module), so a module that wants accuracy, top-k or any torchmetric defines::

    def pipeline_eval_step(self, output, batch, batch_idx, stage):  # stage: "val" or "test"
        self.val_acc.update(output.argmax(-1), batch[1])
        self.log("val_acc", self.val_acc)

It runs on each replica's last-stage rank with the last layer's output for the whole batch
(micro-batches merged along dim 0), where the module's torchmetrics are updated. Its ``self.log``
calls are recorded there, not made, and every rank of the world then makes the same calls in the
same order with its own replica's values (one ``all_gather_object`` per batch), so
``ModelCheckpoint``/``EarlyStopping`` monitoring ``val_acc`` find it on every rank and agree, and
the collectives Lightning runs for ``sync_dist`` match everywhere.

A torchmetric's state is updated on the last-stage ranks only; the other ranks keep its empty
default state and count the same updates. At ``compute()`` torchmetrics syncs the state over the
world, where the empty states add nothing to a ``sum``/``cat``/``max``/``min`` reduction: the
result is the one data-parallel training over the replicas' last-stage states gives, on every
rank. A metric state reduced otherwise (``mean``, a custom function), ``sync_on_compute=False`` or
``dist_sync_on_step=True`` (a collective on the last stage alone) cannot be exact this way and is
refused with the fix.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from ..plan.topology import Topology

_EXACT_REDUCTIONS = ("dim_zero_sum", "dim_zero_cat", "dim_zero_max", "dim_zero_min")


def eval_step_hook(module) -> Any:
    hook = getattr(module, "pipeline_eval_step", None)
    return hook if callable(hook) else None


def metrics_of(module: nn.Module) -> dict[str, Any]:
    """The module's torchmetrics by their ``named_modules`` path (the same on every rank)."""
    from torchmetrics import Metric

    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def check_no_step_sync(metrics: dict[str, Any]) -> None:
    """Before the hook runs (on every rank): a metric that syncs at every update would start a
    collective on the last stage's ranks alone."""
    bad = [f"{name} ({type(m).__name__})" for name, m in metrics.items() if m.dist_sync_on_step]
    if bad:
        raise ValueError(f"{', '.join(bad)} {'has' if len(bad) == 1 else 'have'} dist_sync_on_step=True: under "
                         "DynMoStrategy pipeline_eval_step runs on the last stage's ranks only, where a sync at every "
                         "update would wait for ranks that never update. Construct the metric with "
                         "dist_sync_on_step=False (the default); it still syncs over every rank at compute()")


def metric_problems(metrics: dict[str, Any]) -> list[str]:
    """Why each metric could not be made exact by syncing last-stage states (empty: none)."""
    problems = []
    for name, m in metrics.items():
        if not m.sync_on_compute:
            problems.append(f"{name} ({type(m).__name__}) has sync_on_compute=False, so the ranks that hold no last "
                            "stage would compute it from an empty state; construct it with sync_on_compute=True")
        for state, fn in m._reductions.items():
            if getattr(fn, "__name__", None) not in _EXACT_REDUCTIONS:
                problems.append(f"{name} ({type(m).__name__}) reduces its state {state!r} by "
                                f"{getattr(fn, '__name__', fn)!r}; under the pipeline only the last stage updates "
                                "metrics, so states must reduce by 'sum', 'cat', 'max' or 'min' (e.g. MeanMetric "
                                "keeps sums)")
    return problems


class LogRecorder:
    """Stands in for ``module.log`` while the hook runs: keeps each call (values on the CPU,
    torchmetrics by path) so that every rank can make it afterwards."""

    def __init__(self, module: nn.Module, metrics: dict[str, Any]) -> None:
        self.module = module
        self.path_of = {id(m): name for name, m in metrics.items()}
        self.calls: list[tuple[str, tuple, dict]] = []

    def __call__(self, name: str, value: Any, **kwargs: Any) -> None:
        if id(value) in self.path_of:
            self.calls.append((name, ("metric", self.path_of[id(value)]), kwargs))
            return
        if isinstance(value, nn.Module):
            raise TypeError(f"self.log({name!r}, ...) got a {type(value).__name__} that is not an attribute of the "
                            "module; assign the metric to the LightningModule (e.g. self.val_acc = ...) first")
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self.calls.append((name, ("value", move_data_to_device(value, torch.device("cpu"))), kwargs))

    @contextlib.contextmanager
    def recording(self):
        self.module.log = self  # an instance attribute shadows LightningModule.log (log_dict calls it too)
        try:
            yield self
        finally:
            del self.module.log


def run_eval_step(module, hook, output, batch, batch_idx: Any, stage: str) -> dict:
    """Run ``hook`` on a last-stage rank; what every rank needs to replay it (or the error)."""
    metrics = metrics_of(module)
    before = {name: m._update_count for name, m in metrics.items()}
    recorder = LogRecorder(module, metrics)
    try:
        with recorder.recording():
            hook(output, batch, batch_idx, stage)
    except Exception as err:  # noqa: BLE001 - raised on every rank by replay()
        return {"error": f"{type(module).__name__}.pipeline_eval_step raised {type(err).__name__}: {err}"}
    updates = {name: m._update_count - before[name] for name, m in metrics.items() if m._update_count != before[name]}
    return {"error": None, "calls": recorder.calls, "updates": updates}


def exchange(record: dict | None, topology: Topology, last_ranks: list[int]) -> dict:
    """Every rank's replica's record (``last_ranks[d]``: the global rank that ran replica ``d``'s
    last stage); a collective over the world, once per evaluation batch."""
    gathered: list = [None] * topology.world_size
    dist.all_gather_object(gathered, record)  # NCCL: on the current CUDA device, which Lightning set
    rank = dist.get_rank()
    mine = gathered[last_ranks[topology.dp_rank(rank)]]
    failed = next((r["error"] for r in gathered if r is not None and r["error"]), None)
    return {"error": failed} if failed else mine


def replay(module, record: dict, ran_here: bool, device: torch.device) -> None:
    """Make the recorded ``log`` calls on this rank, after counting the metrics' updates where
    they did not run (their states stay empty here; see the module docstring)."""
    if record.get("error"):
        raise RuntimeError(record["error"])
    metrics = metrics_of(module)
    problems = metric_problems({name: metrics[name] for name in record["updates"]})
    if problems:
        raise ValueError("pipeline_eval_step's metrics cannot be synchronised exactly under DynMoStrategy: "
                         + "; ".join(problems))
    if not ran_here:
        for name, count in record["updates"].items():
            metrics[name]._update_count += count
            metrics[name]._computed = None
    for name, (kind, value), kwargs in record["calls"]:
        if kind == "metric":
            value = metrics[value]
        elif isinstance(value, torch.Tensor):
            value = value.to(device)
        module.log(name, value, **kwargs)
