"""``trainer.validate`` / ``trainer.test`` (and the validation inside ``fit``) through the
pipeline: forward with the loss, no backward; the batch loss on every rank. The loss's exchange
also carries the cluster signals every rank received, so a preemption during a long validation is
acted on after the current batch (``strategy/signals.py``)."""
from __future__ import annotations

from typing import Any

from ..protocol import split_batch
from ..runtime.engine import raise_step_problem
from ..runtime.step_stats import share_eval_loss
from .signals import act_on_signals, signal_flags


def eval_batch(strategy, stage: str, batch: Any):
    """Runs the pipeline without backward; returns the batch loss on every rank and logs
    ``{stage}_loss`` (model-specific metrics such as perplexity are the model's to log)."""
    s = strategy
    inputs, targets = split_batch(batch)
    ctx = s.precision_plugin.val_step_context() if stage == "val" else s.precision_plugin.test_step_context()
    losses, problem = None, None
    if not s.released:
        with ctx:
            engine = s._engine_for(inputs, targets, train=False)
            losses, problem = engine.run(inputs, targets, train=False), engine.problem
    trainer = s.lightning_module.trainer
    loss, flagged, signals = share_eval_loss(losses, s.topology.dp, s.root_device, problem is not None,
                                             signal_flags(s._signals, trainer))
    raise_step_problem(problem, flagged)
    act_on_signals(s._signals, trainer, *signals)
    s.lightning_module.log(f"{stage}_loss", loss, prog_bar=True, on_step=False, on_epoch=True,
                           batch_size=inputs.shape[0], sync_dist=True)  # identical everywhere: mean is exact
    hook = getattr(s.lightning_module, "on_pipeline_eval_loss", None)
    if callable(hook):  # tokens: what the loss averaged over (the counted targets where the model says)
        count = getattr(s.lightning_module, "pipeline_loss_tokens", None)
        hook(stage, loss, int(count(targets)) if callable(count) and targets is not None else inputs.numel())
    return loss
