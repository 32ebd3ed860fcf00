"""Trains an MoEGPT under DynMoStrategy (torchrun) or single-process Lightning; records what
tests compare.

Usage: torchrun --nproc-per-node N tests/support/workers/moe_worker.py SPEC.json
       python tests/support/workers/moe_worker.py SPEC.json          (single process, no strategy)
SPEC: {"out": path, "runs": [config, ...]}. A config: steps, batch (per replica), moe (MoEConfig
fields), pp (absent: single process), schedule, microbatches, balancer, rebalance,
rebalance_interval, rebalance_cooldown, imbalance_threshold, monitor_threshold (MoELoadMonitor's
shift_threshold), expert_parallel, dp_sharding, accumulate (accumulate_grad_batches), per_expert
(experts with weights of their own), block_expert ([expert, batch indices] the routers skip),
checkpointing (activation checkpointing), repack, save_ckpt (a Lightning checkpoint at the last
step), checkpoint_format (default "single"), resume (a checkpoint to resume from), n_samples, dp
(single process only: train on the global batch of that many replicas, in their sampler's order).
Rank 0 writes {"runs": [...]} with the losses, the gradient norms before and after clipping, the
state dict and optimizer state paths, the
rebalance history, the MoELoadMonitor's last per-layer statistics, per rank, the expert rows
each local MoE layer holds and whether each local parameter is a DTensor (an FSDP shard), and the
load signal (:class:`LoadSignal`).
"""
from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.callbacks.moe import MoELoadMonitor
from lightning_dynmo.models import MoEGPT
from lightning_dynmo.strategy.checkpointer import checkpointer_for
from lightning_dynmo.strategy.options import CheckpointFormat
from tests.support.per_expert import BlockExpert, use_per_expert_weights
from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec
from tests.support.workers.real_models_worker import InfGradient, ScaleRecorder, precision_kwargs


class GradNorms(L.Callback):
    """The whole model's gradient norm per step, before clipping and after it (what the optimizer
    stepped on; gradients stay until the next step's zero_grad). Under the pipeline every rank
    holds a part: replicated gradients count once per stage (summed over the world, divided by
    the replicas), an expert shard once per shard (a shard is on dp / expert_parallel replicas)."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.after: list[float] = []

    @staticmethod
    def _norm(trainer, module) -> float:
        sq, sharded = torch.zeros(2, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for name, p in module.named_parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):  # dp_sharding="fsdp": each stage's shards count once
                sharded += p.grad.to_local().double().square().sum()
            else:
                sq[int("experts." in name)] += p.grad.double().square().sum()
        if not torch.distributed.is_initialized():
            return float(sq.sum().sqrt())
        sq = torch.cat([sq, sharded.reshape(1)])
        torch.distributed.all_reduce(sq)
        s = trainer.strategy.pipeline
        dp, ep = s.topology.dp, s.options.expert_parallel
        return float((sq[0] / dp + sq[1] * ep / dp + sq[2]).sqrt())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before.append(self._norm(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(self._norm(trainer, pl_module))


class SharedDigest(L.Callback):
    """At the end of training, a digest of every parameter this rank holds outside the experts
    (replicas of a stage must hold equal ones; under ``dp_sharding="fsdp"`` of this rank's shard)."""

    def __init__(self) -> None:
        self.digest = {}

    def on_train_end(self, trainer, pl_module):
        self.digest = {n: float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum())
                       for n, p in pl_module.named_parameters() if "experts." not in n and p.numel()}


class LoadSignal(L.Callback):
    """Per step: under the pipeline, the strategy's combined ``layer_load`` and, per rank, each
    local MoE block's own relative work (its monitoring window, restarted every step); in a single
    process, each MoE layer's ``[rows, num_experts]`` expert slots kept per row, from the router's
    decisions, for computing the expected signal independently."""

    def __init__(self) -> None:
        self.combined: list[list[float | None]] = []
        self.local: list[dict[int, float]] = []
        self.rows: list[dict[int, list]] = []
        self._step_rows: dict[int, list] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        if isinstance(trainer.strategy, DynMoStrategy):
            return
        for i, block in pl_module.moe_blocks():
            block.mlp.router.register_forward_hook(self._recorder(i, block.mlp.num_experts))

    def _recorder(self, layer: int, num_experts: int):
        def hook(router, args, routing) -> None:
            if router.training and torch.is_grad_enabled():
                kept = torch.ones_like(routing.experts, dtype=torch.bool) if routing.keep is None else routing.keep
                rows = torch.zeros(routing.experts.shape[0], num_experts, dtype=torch.int64)
                for k in range(routing.experts.shape[2]):
                    rows.scatter_add_(1, routing.experts[:, :, k], kept[:, :, k].long())
                self._step_rows[layer] = rows.tolist()
        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for _, block in pl_module.moe_blocks():
            block.reset_routing_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(trainer.strategy, DynMoStrategy):
            self.combined.append(trainer.strategy.pipeline.layer_load)
            self.local.append({i: block.routing_stats().relative_work for i, block in pl_module.moe_blocks()})
        else:
            self.rows.append(self._step_rows)
            self._step_rows = {}


def build_model(cfg: dict) -> MoEGPT:
    dense = make_model(cfg)  # the shared test GPT's sizes and heterogeneous widths
    model = MoEGPT(dense.config, moe=cfg["moe"], lr=cfg.get("lr", 3e-3), warmup_steps=2, max_steps=20,
                   seed=cfg.get("seed", 0))
    if cfg.get("per_expert"):  # each expert its own weights: an empty one gets none (tests/support/per_expert.py)
        use_per_expert_weights(model)
    return model


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pipeline = "pp" in cfg
    if pipeline:
        strategy = DynMoStrategy(
            pipeline_parallel=cfg["pp"],
            schedule=cfg.get("schedule", "1f1b"),
            microbatches=cfg.get("microbatches", 4),
            balancer=cfg.get("balancer", "uniform"),
            rebalance=cfg.get("rebalance", "never"),
            rebalance_interval=cfg.get("rebalance_interval", 1),
            rebalance_cooldown=cfg.get("rebalance_cooldown", 10),
            imbalance_threshold=cfg.get("imbalance_threshold", 0.1),
            overhead_budget=cfg.get("overhead_budget", 0.01),
            expert_parallel=cfg.get("expert_parallel", 1),
            activation_checkpointing=cfg.get("checkpointing", False),
            repack=cfg.get("repack", "off"),
            dp_sharding=cfg.get("dp_sharding", "replicate"),
            checkpoint_format=cfg.get("checkpoint_format", "single"),
            plot=False,
            timeout=120,
        )
        kw = dict(strategy=strategy, devices=world)
    else:
        kw = dict(devices=1)
    rec, monitor, norms = LossRecorder(), MoELoadMonitor(cfg.get("monitor_threshold", 0.05)), GradNorms()
    signal = LoadSignal()
    callbacks = [rec, monitor, norms, signal]
    if cfg.get("precision"):
        kw.update(precision_kwargs(cfg))
    inf = None
    if cfg.get("inf_at"):  # [step, parameter name]: inf in that gradient on data-parallel replica 0 only
        inf = ScaleRecorder(), SharedDigest()
        callbacks += [InfGradient(*cfg["inf_at"], replica=0), *inf]
    if cfg.get("block_expert"):  # [expert, [batch indices]]: the routers may not choose it on those batches
        callbacks.append(BlockExpert(*cfg["block_expert"]))
    freezing = None
    if cfg.get("freezing"):  # LayerFreezing kwargs; its per-layer gradient-norm means are recorded per rank
        from lightning_dynmo.callbacks import LayerFreezing
        freezing = LayerFreezing(**cfg["freezing"])
        callbacks.append(freezing)
    ckpt_dir = os.path.join(out_dir, f"moe_ckpt{idx}")
    if cfg.get("save_ckpt"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True,
                                                             every_n_train_steps=cfg["steps"]))
    model = build_model(cfg)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=cfg["steps"], logger=False, enable_checkpointing=bool(cfg.get("save_ckpt")),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        gradient_clip_val=cfg.get("clip"), callbacks=callbacks, default_root_dir=out_dir,
        accumulate_grad_batches=cfg.get("accumulate", 1), **kw,
    )
    dp = 1 if pipeline else cfg.get("dp", 1)
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"] * dp, reference=not pipeline, dp=dp),
                ckpt_path=cfg.get("resume"))
    expert_rows = {i: len(block.mlp.experts.w1) for i, block in model.moe_blocks()}  # (a ParameterList per expert too)
    if pipeline:  # the full state, gathered onto rank 0 whatever format the checkpoints have
        trainer.strategy.checkpointer = checkpointer_for(CheckpointFormat.SINGLE)  # the format, switched
        state = trainer.strategy.lightning_module_state_dict()
        optim = trainer.strategy.optimizer_state(trainer.optimizers[0])
        history = trainer.strategy.pipeline.rebalance_history
        per_rank, local_load, kinds = [None] * world, [None] * world, [None] * world
        torch.distributed.all_gather_object(per_rank, expert_rows)
        torch.distributed.all_gather_object(local_load, signal.local)
        torch.distributed.all_gather_object(kinds, {n: isinstance(p, DTensor) for n, p in model.named_parameters()})
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optim = trainer.optimizers[0].state_dict()
        history, per_rank, local_load, kinds = [], [expert_rows], [], []
    result = {"losses": rec.losses, "grad_norms": norms.before, "clipped_grad_norms": norms.after, "history": history,
              "load": monitor.last_stats, "expert_rows_per_rank": per_rank,
              "layer_load": signal.combined, "local_load_per_rank": local_load, "routing_rows": signal.rows,
              "dtensor_params_per_rank": kinds}
    if freezing is not None and pipeline:
        means = [None] * world
        torch.distributed.all_gather_object(means, freezing._prev)
        result["freezing_means_per_rank"], result["frozen"] = means, freezing.n_frozen
    if inf is not None and pipeline:
        scales, digests = [None] * world, [None] * world
        torch.distributed.all_gather_object(scales, inf[0].scales)
        torch.distributed.all_gather_object(digests, inf[1].digest)
        result["scales_per_rank"], result["shared_digest_per_rank"] = scales, digests
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"moe_state{idx}.pt")
        result["optim"] = os.path.join(out_dir, f"moe_optim{idx}.pt")
        torch.save(state, result["state"])
        torch.save(optim, result["optim"])
        if cfg.get("save_ckpt"):
            result["ckpt"] = os.path.join(ckpt_dir, "last.ckpt")
    return result


if __name__ == "__main__":
    run_spec(run_one)
