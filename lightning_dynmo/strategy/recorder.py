"""Where decisions go: Lightning metrics, ``rebalance_history.jsonl`` and timeline plots."""
from __future__ import annotations

import json
import os
from typing import Sequence

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..plan.cost_model import CostModel, LayerCosts, imbalance
from ..plan.partition import Partition
from ..plan.decision import Decision

#: Decision fields logged as ``rebalance/<field>`` metrics.
METRIC_FIELDS = ("decision_ms", "migration_ms", "migration_bytes", "imbalance_before", "imbalance_after",
                 "bubble_before", "bubble_after", "predicted_step_before", "predicted_step_after")


class DecisionRecorder:
    """Every decision goes to the metrics and ``rebalance_history.jsonl``; a PNG is drawn only for
    applied decisions, at most one per ``plot_interval`` steps (per-iteration rebalancing would
    otherwise write a file per step)."""

    def __init__(self, plot: bool, plot_interval: int = 50) -> None:
        self.plot = plot
        self.plot_interval = plot_interval
        self.decisions: list[Decision] = []
        self._last_plot_step: int | None = None

    def _should_plot(self, decision: Decision) -> bool:
        if not (self.plot and decision.applied):
            return False
        return self._last_plot_step is None or decision.step - self._last_plot_step >= self.plot_interval

    def record(self, module, decision: Decision, partition: Partition, out_dir: str | None, is_global_zero: bool,
               costs: LayerCosts | None = None, model: CostModel | None = None, events: Sequence[dict] = (),
               before: Partition | None = None, after: Partition | None = None) -> None:
        """Log ``decision`` (call on every rank; files are written by global rank 0 only)."""
        self.decisions.append(decision)
        for key in METRIC_FIELDS:
            value = getattr(decision, key)
            if value is not None:
                module.log(f"rebalance/{key}", float(value), on_step=True, on_epoch=False, batch_size=1)
        for s, b in enumerate(partition.boundaries[1:-1], start=1):
            module.log(f"partition/b{s}", float(b), on_step=True, on_epoch=False, batch_size=1)
        if not is_global_zero:
            return
        rank_zero_info(
            f"dynmo {decision.kind} @ step {decision.step} ({decision.reason}): {decision.before} -> "
            f"{decision.after or decision.before} applied={decision.applied} ({decision.why})"
        )
        if out_dir is None:
            return
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "rebalance_history.jsonl"), "a") as fh:
            fh.write(json.dumps(decision.to_record()) + "\n")
        if self._should_plot(decision) and events and costs is not None and model is not None and before is not None:
            from .. import plotting

            self._last_plot_step = decision.step
            plotting.save_rebalance_figure(
                os.path.join(out_dir, f"rebalance_step{decision.step:06d}.png"),
                events,
                before=(str(before), model.stage_times(costs, before)),
                after=(str(after), model.stage_times(costs, after)) if after is not None else None,
                title=f"step {decision.step}: {decision.reason}",
            )


def write_cost_trace(out_dir: str | None, is_global_zero: bool, row: dict) -> None:
    """Append one profiled step's per-layer costs to ``cost_trace.jsonl`` (rank 0): what the
    simulator replays (:mod:`lightning_dynmo.sim`) to predict this run's step time at any scale."""
    if not is_global_zero or out_dir is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cost_trace.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")


def notify_released(module, pp_size: int, released: list[int]) -> None:
    """Tell the launcher/scheduler: ``on_workers_released(ranks)`` on the LightningModule and
    on every callback that defines it, plus a log line and a metric."""
    for obj in [module, *module.trainer.callbacks]:
        hook = getattr(obj, "on_workers_released", None)
        if callable(hook):
            hook(released)
    module.log("pipeline/ranks", float(pp_size), on_step=True, on_epoch=False, batch_size=1)
    rank_zero_info(f"dynmo: packed onto {pp_size} pipeline ranks per replica; released ranks {released}")


def dynmo_summary_text(summary: dict) -> str:
    """The end-of-fit sanity check in words: did DynMo pay on this model?"""
    frac = summary.get("overhead_fraction")
    lines = [f"dynmo: overhead {summary['overhead_s'] * 1e3:.0f} ms of {summary['train_s']:.1f} s of pipeline steps"
             + (f" ({frac:.2%})" if frac is not None else "")
             + f", migrations {summary['migration_s'] * 1e3:.0f} ms; {summary['decisions']} decisions, "
             f"{summary['skipped']} skip records"]
    for p in summary.get("applied_decisions", []):
        if p["step_ms_after"] is None or p["gain"] is None:
            before = p.get("step_ms_before")  # 0 when the step before was not measured (e.g. a rebalance every step)
            lines.append(f"  step {p['step']}: applied, step time "
                         + (f"{before:.1f} ms before, not measured after" if before else "not measured"))
        else:
            lines.append(f"  step {p['step']}: step time {p['step_ms_before']:.1f} -> {p['step_ms_after']:.1f} ms "
                         f"({-p['gain']:+.1%}), cost {p['cost_ms']:.0f} ms: "
                         + ("paid for itself" if p["paid"] else "did not pay"))
    for d in summary.get("stragglers", []):  # decisions taken for a slow rank
        lines.append(f"  step {d['step']}: balanced for {d['straggler']} the fastest's speed"
                     + ("" if d["applied"] else " (nothing moved)"))
    return "\n".join(lines)


def log_step(module, stats, inputs, now: float, last_step_end: float | None, replicas: int, pp_size: int) -> None:
    """The loss for the progress bar plus ``pipeline/*`` metrics; model metrics are the model's."""
    bs = inputs.shape[0]
    module.log("train_loss", stats.loss, prog_bar=True, on_step=True, batch_size=bs)
    if last_step_end is not None and now > last_step_end:
        module.log("pipeline/tokens_per_sec", inputs.numel() * replicas / (now - last_step_end), prog_bar=True,
                   on_step=True, batch_size=bs)
    wall = max(stats.rank_wall) if stats.rank_wall else 0.0
    if wall > 0 and pp_size > 1:
        idle = 1.0 - sum(stats.rank_busy) / (len(stats.rank_busy) * wall)
        module.log("pipeline/idle_fraction", max(0.0, idle), on_step=True, batch_size=bs)
        module.log("pipeline/imbalance", imbalance(stats.rank_busy), on_step=True, batch_size=bs)
