"""``trainer.validate`` / ``trainer.test`` (and the validation inside ``fit``) through the
pipeline: forward with the loss, no backward; the batch loss on every rank. The loss's exchange
also carries the cluster signals every rank received, so a preemption during a long validation is
acted on after the current batch (``strategy/signals.py``)."""
from __future__ import annotations

from typing import Any

from ..protocol import split_batch
from ..runtime.engine import raise_step_problem
from ..runtime.groups import group_ranks
from . import eval_metrics
from ..runtime.step_stats import share_eval_loss
from .signals import DeferredSignals, act_on_signals, signal_flags


def eval_batch(pipeline, plugin, signals: DeferredSignals | None, stage: str, batch: Any, batch_idx: Any = None):
    """Runs the pipeline without backward; returns the batch loss on every rank and logs
    ``{stage}_loss``; the module's optional ``pipeline_eval_step`` sees the last layer's output
    (``strategy/eval_metrics.py``)."""
    s = pipeline
    module = s.lightning_module
    inputs, targets = split_batch(batch)
    ctx = plugin.val_step_context if stage == "val" else plugin.test_step_context  # a fresh context per use
    hook = eval_metrics.eval_step_hook(module)
    if hook is not None:
        eval_metrics.check_no_step_sync(eval_metrics.metrics_of(module))
    losses, problem, engine = None, None, None
    if not s.released:
        with ctx():
            engine = s.engine_for(inputs, targets, plugin, train=False)
            losses, problem = engine.run(inputs, targets, train=False, keep_output=hook is not None), engine.problem
    trainer = module.trainer
    loss, flagged, flags = share_eval_loss(losses, s.topology.dp, s.root_device, problem is not None,
                                             signal_flags(signals, trainer))
    raise_step_problem(problem, flagged)
    act_on_signals(signals, trainer, *flags)
    if hook is not None:
        ran_here = engine is not None and engine.has_last
        record = None
        if ran_here:
            with ctx():
                record = eval_metrics.run_eval_step(module, hook, engine.output, batch, batch_idx, stage)
            engine.output = None
        layout = s.layout
        last_ranks = [group_ranks(g)[layout.rank_of_stage(layout.num_stages - 1)] for g in s.groups.replicas]
        record = eval_metrics.exchange(record, s.topology, last_ranks)
        eval_metrics.replay(module, record, ran_here, s.root_device)
    module.log(f"{stage}_loss", loss, prog_bar=True, on_step=False, on_epoch=True,
               batch_size=inputs.shape[0], sync_dist=True)  # identical everywhere: mean is exact
    on_loss = getattr(module, "on_pipeline_eval_loss", None)
    if callable(on_loss):  # tokens: what the loss averaged over (the counted targets where the model says)
        count = getattr(module, "pipeline_loss_tokens", None)
        on_loss(stage, loss, int(count(targets)) if callable(count) and targets is not None else inputs.numel())
    return loss
