"""Reliability cases under DynMoStrategy, several per torchrun launch.

Usage: torchrun --nproc-per-node N tests/support/workers/reliability_worker.py SPEC.json
SPEC: {"out": path, "runs": [config, ...]}. A config has a ``case`` (see ``run_one``) plus the
usual keys (steps, batch, pp, schedule, microbatches, partition, n_layer, ...). An exception from
``trainer.fit`` is caught and recorded per rank, so one launch checks many failure modes: every
rank must raise the same clear error at the same point (never a hang). Rank 0 writes
{"runs": [{"per_rank": [...], ...}, ...]}.
"""
from __future__ import annotations

import os
import time
import warnings

import torch

torch.set_num_threads(1)

import lightning as L
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy, Partition, register_balancer
from lightning_dynmo.models import GPT
from lightning_dynmo.plan.balancers import BalanceResult, get_balancer

from tests.support.workers.common import FreezeThenUnfreeze, LossRecorder, make_loader, make_model, run_spec


# ---------------------------------------------------------------------------------- modules
class ViewLayer(nn.Module):
    """Returns a view of its input (what a reshape/view/transpose at a stage end does)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "transpose":
            return x.transpose(1, 2).transpose(1, 2)
        if self.kind == "reshape":
            return x.reshape(x.shape)
        return x.view(x.shape)


def view_model(cfg: dict) -> GPT:
    """GPT with a view-returning layer after the embedding and after every block:
    [Emb, V, Blk, V, Blk, V, ..., Norm, Head]."""
    model = make_model(cfg)
    old = list(model.layers)
    kinds = ["view", "transpose", "reshape"]
    new = [old[0], ViewLayer(kinds[0])]
    for k, blk in enumerate(old[1:-2], start=1):
        new += [blk, ViewLayer(kinds[k % 3])]
    new += old[-2:]
    model.layers = nn.ModuleList(new)
    return model


class NaNLossGPT(GPT):
    """``pipeline_loss`` is NaN in training batch ``nan_at`` (counted on every rank)."""

    nan_at = 2

    def on_train_batch_start(self, batch, batch_idx):
        self._batches = getattr(self, "_batches", -1) + 1

    def pipeline_loss(self, output, target):
        loss = super().pipeline_loss(output, target)
        if self.training and getattr(self, "_batches", -1) == self.nan_at:
            loss = loss * float("nan")
        return loss


class VectorLossGPT(GPT):
    def pipeline_loss(self, output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="none")


class DetachedLossGPT(GPT):
    """``pipeline_loss`` of a detached output: one process raises, a pipeline must too."""

    def pipeline_loss(self, output, target):
        return super().pipeline_loss(output.detach(), target)


class StepLoggingGPT(GPT):
    """A user model as many are written: logging in ``training_step`` and no pipeline loss hook."""

    on_pipeline_train_loss = None

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("my_metric", loss.detach())
        return loss


class HookGPT(GPT):
    """Defines the documented per-step loss hook (so the skipped-training_step warning is silent)."""

    def on_pipeline_train_loss(self, loss, batch, batch_idx):
        self.hook_calls = getattr(self, "hook_calls", []) + [(int(batch_idx), float(loss))]


class AugmentedTokens(torch.utils.data.Dataset):
    """Token sequences with one position replaced by a token drawn from the *global* RNG (an
    augmentation as many datasets write it): the draws follow each rank's RNG."""

    def __init__(self, cfg: dict):
        x, y = make_loader(cfg, 1).dataset.tensors
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].clone()
        x[int(torch.randint(0, x.numel(), ()))] = int(torch.randint(0, 64, ()))
        return x, self.y[i]


class FinetuneFirstLayers(L.pytorch.callbacks.BaseFinetuning):
    """Lightning's own fine-tuning recipe: the first two layers frozen before the optimizer is
    built, unfrozen and added as a new param group at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(list(pl_module.pipeline_layers())[:2])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(list(pl_module.pipeline_layers())[:2], optimizer)


class RepackOnRankZero(L.Callback):
    """``request_repack(1)`` at the end of step 1, on rank 0 only (``if trainer.is_global_zero``)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1 and trainer.is_global_zero:
            trainer.strategy.pipeline.request_repack(1)


class SeedGlobalRNG(L.Callback):
    """``torch.manual_seed`` on every rank when training starts (what ``seed_everything`` does):
    the ranks' global RNGs agree there and drift apart as dropout runs on some ranks only."""

    def on_train_start(self, trainer, pl_module):
        torch.manual_seed(1234)


# ---------------------------------------------------------------------------------- balancers
def _shifted(problem, shift: int) -> BalanceResult:
    base = get_balancer("uniform")(problem).partition
    b = list(base.boundaries)
    b[1] = min(max(1, b[1] + shift), b[2] - 1)
    new = Partition(tuple(b))
    t = problem.model.predicted_step_time(problem.costs, new)
    return BalanceResult(partition=new, rounds=1, predicted_step_time=t, max_load=t, name="rank_dependent")


@register_balancer("rank_dependent_setup", override=True)
def rank_dependent_setup(problem):
    """Not deterministic: each rank shifts the first boundary by its own rank."""
    return _shifted(problem, -int(os.environ.get("RANK", "0")))


@register_balancer("rank_dependent_later", override=True)
def rank_dependent_later(problem):
    """Agrees at setup (no current partition), disagrees at every later decision."""
    if problem.current is None:
        return _shifted(problem, 0)
    return _shifted(problem, -int(os.environ.get("RANK", "0")))


@register_balancer("one_layer_short", override=True)
def one_layer_short(problem):
    """Wrong size: splits one layer fewer than the problem has."""
    b = list(get_balancer("uniform")(problem).partition.boundaries)
    b[-1] -= 1
    return BalanceResult(partition=Partition(tuple(b)), rounds=1, predicted_step_time=0.0, max_load=0.0, name="short")


@register_balancer("one_layer_short_later", override=True)
def one_layer_short_later(problem):
    """Right at setup (no current partition), one layer short at every later decision."""
    if problem.current is None:
        return get_balancer("uniform")(problem)
    return one_layer_short(problem)


@register_balancer("bare_partition", override=True)
def bare_partition(problem):
    """Returns a Partition where a BalanceResult is due."""
    return get_balancer("uniform")(problem).partition


# ---------------------------------------------------------------------------------- callbacks
class RequestEveryStep(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.pipeline.request_rebalance("test request")


class ProfileOnce(L.Callback):
    """Asks for a profile at step 0 (step 1 is profiled); at the end gathers the per-layer costs."""

    def __init__(self):
        self.costs = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            trainer.strategy.pipeline.request_rebalance("profile for the test")

    def on_train_end(self, trainer, pl_module):
        costs, _ = trainer.strategy.pipeline.gather_layer_costs()
        self.costs = {"forward": list(costs.forward), "backward": list(costs.backward),
                      "partition": list(trainer.strategy.pipeline.partition.boundaries)}


class BatchOrder(L.Callback):
    def __init__(self):
        self.first_tokens = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.first_tokens.append(batch[0][:, 0].tolist())


class KillOnce(L.Callback):
    """``os._exit`` on ``rank`` at ``step`` in the first attempt of a torchrun job only."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_step == self.step and trainer.global_rank == self.rank:
            os._exit(7)


class InvalidateOnOneRank(L.Callback):
    """``strategy.pipeline.invalidate_pipeline()`` on ``rank`` only, at ``step`` (as GradualPruning does
    where a local layer's storage changed)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            trainer.strategy.pipeline.invalidate_pipeline()


class WritePidsAndCrawl(L.Callback):
    """Writes this rank's pid, then makes every step slow (a long job to kill the launcher under)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        with open(os.path.join(self.out_dir, f"pid{trainer.global_rank}"), "w") as fh:
            fh.write(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.2)


# ---------------------------------------------------------------------------------- runs
def build(cfg: dict, out_dir: str, idx: int):
    case = cfg["case"]
    model_cls = {"nan_loss": NaNLossGPT, "vector_loss": VectorLossGPT, "detached_loss": DetachedLossGPT,
                 "hook": HookGPT, "step_logging": StepLoggingGPT}.get(cfg.get("model"), GPT)
    model = view_model(cfg) if cfg.get("model") == "view" else make_model(cfg, cls=model_cls)
    callbacks: list = []
    if case == "request_under_never":
        callbacks.append(RequestEveryStep())
    if case == "order":
        callbacks.append(BatchOrder())
    if cfg.get("augment"):
        callbacks.append(SeedGlobalRNG())
    if case == "repack_rank0":
        callbacks.append(RepackOnRankZero())
    if case == "invalidate_one_rank":
        callbacks.append(InvalidateOnOneRank(**cfg["invalidate"]))
    if case == "finetune":
        callbacks.append(FinetuneFirstLayers())
    if case == "unfreeze":
        callbacks.append(FreezeThenUnfreeze(**cfg["unfreeze"]))
    if case.startswith("profile"):
        callbacks.append(ProfileOnce())
    if case in ("restart", "restart_reference"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=os.path.join(out_dir, f"ckpt{idx}"), save_last=True, every_n_train_steps=cfg["ckpt_every"],
            save_top_k=-1))
        if case == "restart":
            callbacks.append(KillOnce(cfg["kill_at"], 1))
    if case == "crawl":
        callbacks.append(WritePidsAndCrawl(out_dir))
    kw = dict(pipeline_parallel=cfg.get("pp", 2), schedule=cfg.get("schedule", "1f1b"),
              microbatches=cfg.get("microbatches", 4), partition=cfg.get("partition"), plot=False,
              timeout=cfg.get("timeout", 30))
    for key in ("balancer", "rebalance", "rebalance_interval", "on_nonfinite"):
        if key in cfg:
            kw[key] = cfg[key]
    return model, DynMoStrategy(**kw), callbacks


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if cfg.get("late_start") and restart != "0" and os.environ.get("RANK") == "1":
        time.sleep(cfg["late_start"])  # a restarted rank that comes up late (a loaded machine)
    model, strategy, callbacks = build(cfg, out_dir, idx)
    rec = LossRecorder()
    reference_loss = None
    if cfg.get("model") == "view":  # single-process loss of the first batch, before training
        x, y = next(iter(make_loader(cfg, cfg.get("batch", 8))))
        with torch.no_grad():
            reference_loss = float(model.pipeline_loss(model(x), y))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=cfg.get("steps", 3), logger=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        gradient_clip_val=cfg.get("clip", 1.0), callbacks=[rec, *callbacks], default_root_dir=out_dir,
    )
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2 if cfg["case"] == "fit_twice" else 1):  # a second fit on the split module must refuse
                loader = make_loader(cfg, cfg.get("batch", 8))
                if cfg.get("augment"):
                    loader = torch.utils.data.DataLoader(AugmentedTokens(cfg), batch_size=cfg.get("batch", 8))
                trainer.fit(model, train_dataloaders=loader, ckpt_path=cfg.get("resume"))
        except Exception as err:  # noqa: BLE001 - recorded and compared by the test
            error = f"{type(err).__name__}: {err}"
    local = {
        "error": error,
        "warnings": [str(w.message) for w in caught],
        "losses": rec.losses,
        "global_step": trainer.global_step,
        "hook_calls": getattr(trainer.lightning_module, "hook_calls", None),
        "order": next((c.first_tokens for c in callbacks if isinstance(c, BatchOrder)), None),
        "costs": next((c.costs for c in callbacks if isinstance(c, ProfileOnce)), None),
        "pipeline_ranks": trainer.strategy.pipeline.layout.pp_size if trainer.strategy.pipeline.layout else None,
    }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, local)
    result = {"per_rank": per_rank, "reference_loss": reference_loss,
              "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT")}
    if error is None and cfg.get("save_state"):
        state = trainer.strategy.lightning_module_state_dict()
        if trainer.global_rank == 0:
            result["state"] = os.path.join(out_dir, f"state{idx}.pt")
            torch.save(state, result["state"])
    return result


if __name__ == "__main__":
    run_spec(run_one)
