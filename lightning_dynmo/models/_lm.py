"""What every causal LM of ours shares as a LightningModule: the loss hooks (single process and
under DynMoStrategy), validation perplexity, and AdamW with warmup + cosine decay.

Subclasses provide ``forward`` (the layers in order) and ``pipeline_loss``; their hyper-parameters
(``save_hyperparameters``) include ``lr, min_lr, warmup_steps, max_steps, weight_decay, betas, eps``.
"""
from __future__ import annotations

import math
import warnings

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..protocol.activations import run_layers

from .vocab_head import IGNORE_INDEX


class WarmupCosine:
    """LR multiplier: linear warmup to ``lr``, cosine decay to ``min_lr`` at ``max_steps``.

    A callable object (not a lambda) so ``LambdaLR.state_dict()`` saves its fields.
    ``max_steps <= 0`` means unknown length: constant ``lr`` after warmup.
    """

    def __init__(self, warmup_steps: int, max_steps: int, lr: float, min_lr: float):
        self.warmup_steps = int(warmup_steps)
        self.max_steps = int(max_steps)
        self.lr = float(lr)
        self.min_lr = float(min_lr)

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.max_steps <= 0:
            return self.lr
        if step >= self.max_steps:
            return self.min_lr
        span = max(1, self.max_steps - self.warmup_steps)
        ratio = (step - self.warmup_steps) / span
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.lr - self.min_lr)

    def __call__(self, step: int) -> float:
        return self.lr_at(step) / self.lr if self.lr > 0 else 0.0


class CausalLMModule(L.LightningModule):
    """Training, evaluation and optimizer hooks shared by GPT and the Hugging Face adapter.

    ``val_ppl`` = exp of the epoch-mean validation loss, each batch weighted by its counted
    targets (``pipeline_loss_tokens``: -100 targets count nothing) (a torchmetrics
    ``MeanMetric``; sum-based, so it syncs correctly across ranks even where some ranks never
    updated it).
    """

    def _init_eval_metric(self, vocab_size: int) -> None:
        with torch.device("cpu"):  # a real tensor even when the layers are built on the meta device
            self.val_loss_mean = MeanMetric()
            classes = max(2, vocab_size)  # torchmetrics wants two classes at least (a one-token vocabulary: tests)
            self.token_accuracy = nn.ModuleDict({stage: MulticlassAccuracy(classes, average="micro",
                                                                           ignore_index=IGNORE_INDEX)
                                                 for stage in ("val", "test")})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.lm_loss(x, y)
        self.log("train_loss", loss, prog_bar=True, batch_size=x.size(0))
        self.on_pipeline_train_loss(loss, batch, batch_idx)
        return loss

    def lm_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The single-process loss of a batch (a chunked head never builds the logits here either)."""
        return self.pipeline_loss(self(x), y)

    def pipeline_loss_tokens(self, target: torch.Tensor) -> torch.Tensor:
        """The terms ``pipeline_loss`` averages over: the targets that are not -100. Under a
        pipeline each micro-batch's loss is weighted by it, so batches with ignored targets
        train on their token mean as in one process (``strategy/token_weights.py``)."""
        return (target != IGNORE_INDEX).sum()

    def on_pipeline_train_loss(self, loss: torch.Tensor, batch, batch_idx) -> None:
        """Per-step logging beyond ``train_loss`` (which DynMoStrategy logs itself, and
        ``training_step`` logs without it): the training perplexity."""
        self.log("train_ppl", torch.exp(loss.detach().float()), batch_size=batch[0].size(0))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        output = run_layers(self.pipeline_layers(), self.pipeline_inputs(x, y))  # what the last stage sees
        loss = self.pipeline_loss(output, y)
        self.val_loss_mean.update(loss.detach(), weight=self.pipeline_loss_tokens(y))  # padding weighs nothing
        self.log("val_loss", loss, prog_bar=True, batch_size=x.size(0))
        self.pipeline_eval_step(output, batch, batch_idx, "val")
        return loss

    def pipeline_eval_step(self, output: torch.Tensor, batch, batch_idx, stage: str) -> None:
        """The next-token accuracy (``{stage}_acc``, targets -100 not counted) from the last
        layer's logits: DynMoStrategy calls it on the last stage's ranks (``validation_step``
        here). A chunked head's last layer returns per-token losses, not logits: no accuracy."""
        target = batch[1]
        if output.dim() != target.dim() + 1:
            return
        accuracy = self.token_accuracy[stage]
        accuracy.update(output.argmax(-1), target)
        self.log(f"{stage}_acc", accuracy, on_step=False, on_epoch=True, batch_size=target.size(0))

    def on_pipeline_eval_loss(self, stage: str, loss: torch.Tensor, tokens: int) -> None:
        """Called by DynMoStrategy, which evaluates through the pipeline instead of calling
        ``validation_step``, with each batch's loss (identical on every rank)."""
        if stage == "val":
            self.val_loss_mean.update(loss.detach(), weight=tokens)

    def on_validation_epoch_end(self) -> None:
        if self.val_loss_mean.update_count == 0:
            return  # no validation batch ran on any rank: nothing to reduce
        # Called unconditionally on every rank: compute() all-reduces the metric state, so
        # branching on rank-local "did I update?" could deadlock. Ranks that never ran
        # validation_step (e.g. non-last pipeline stages) contribute zero weight.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*was called before the ``update``.*")
            mean = self.val_loss_mean.compute()
        if torch.isfinite(mean):  # the same on every rank: compute() reduced it
            # sync_dist: the mean of equal values is that value; without it Lightning warns every
            # distributed user to add it
            self.log("val_ppl", torch.exp(mean), prog_bar=True, sync_dist=True)
        self.val_loss_mean.reset()

    def configure_optimizers(self):
        """AdamW (weight decay on matmul weights and embeddings only) with warmup + cosine decay."""
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(self._optimizer_groups(params), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        min_lr = hp.lr if hp.min_lr is None else hp.min_lr
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, WarmupCosine(hp.warmup_steps, self._schedule_steps(), hp.lr, min_lr))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def _optimizer_groups(self, params: list) -> list[dict]:
        """AdamW's parameter groups: weight decay on matmul weights and embeddings, none on biases
        and norm gains. A model may split further (MoDGPT gives its predictors their own rate);
        the schedule scales every group's rate by the same factor."""
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": self.hparams.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

    def _schedule_steps(self) -> int:
        """hparam ``max_steps``, else ``trainer.max_steps``; <= 0 means constant after warmup."""
        steps = self.hparams.max_steps
        if steps is not None and steps > 0:
            return int(steps)
        trainer = self._trainer
        if trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        return -1
