"""Runs a list of DynMo training configs in one torchrun launch and records what tests compare.

Usage: torchrun --nproc-per-node N tests/workers/pipeline_worker.py SPEC.json
SPEC: {"out": path, "runs": [config, ...]}; each config is a dict (see ``run_one``). Rank 0
writes {"runs": [{"losses": [...], "state": path, "optim": path, "history": [...]}, ...]}.
"""
from __future__ import annotations

import math
import os

import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist

torch.set_num_threads(1)

import lightning as L
from lightning.pytorch.loggers import CSVLogger

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.strategy import checkpoint

from tests.support.evaluation import GPTWithTest, eval_loader
from tests.support.workers.common import LossRecorder, make_loader, make_model, pin_to_own_core, run_spec


class RepackRequest(L.Callback):
    """Calls ``strategy.pipeline.request_repack(target)`` at the end of a given step (on every rank)."""

    def __init__(self, step: int, target):
        self.step, self.target = step, target

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.strategy.pipeline.request_repack(self.target)


class DirectRepack(L.Callback):
    """Calls ``strategy.pipeline.repack_to(ranks, even split)`` at the end of a given step (on every rank)
    and keeps what it returned."""

    def __init__(self, step: int, ranks: int):
        self.step, self.ranks, self.returned = step, ranks, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            from lightning_dynmo.plan.partition import Partition

            n = trainer.strategy.pipeline.partition.num_layers
            sizes = [n // self.ranks + (i < n % self.ranks) for i in range(self.ranks)]
            self.returned = trainer.strategy.pipeline.repack_to(self.ranks, Partition.from_sizes(sizes))


class MidWindowRebalance(L.Callback):
    """After every batch that does not close an accumulation window (on every rank): move layers
    with ``strategy.pipeline.rebalance_to``, alternating between ``partitions``, so the layers carry their
    partially accumulated gradients to their new ranks."""

    def __init__(self, partitions):
        self.partitions, self.moves = [list(p) for p in partitions], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            trainer.strategy.pipeline.rebalance_to(self.partitions[self.moves % len(self.partitions)])
            self.moves += 1


class StarveOnOneReplica(L.Callback):
    """On data-parallel replica 1 only, pipeline layer ``layer``'s submodule ``name`` contributes
    nothing and gets no gradient (its output detached and zeroed): a parameter used by one replica
    and not the other, as MoE routing or early exit can make it."""

    def __init__(self, layer: int, name: str) -> None:
        self.layer, self.name = layer, name

    def on_train_start(self, trainer, pl_module):
        from lightning_dynmo.protocol import RemoteLayer, pipeline_layers_of

        layer = pipeline_layers_of(pl_module)[self.layer]
        if trainer.strategy.distributed_sampler_kwargs["rank"] == 1 and not isinstance(layer, RemoteLayer):
            layer.get_submodule(self.name).register_forward_hook(lambda m, args, out: out.detach() * 0)


class SlowOnRank(L.Callback):
    """A genuinely slower rank: on global rank ``rank``, during steps ``start <= step < stop``,
    every pipeline layer's forward runs ``repeat`` times (the extra runs under no_grad, their
    outputs dropped: the math is unchanged), wherever the layers are. A global forward hook, so
    that layers arriving by migration (new modules) are slowed too."""

    def __init__(self, rank: int, start: int, stop: int, repeat: int, classes: tuple[type, ...]) -> None:
        self.rank, self.start, self.stop, self.repeat, self.classes = rank, start, stop, repeat, classes
        self.active, self._inside, self._handle = False, False, None

    def _hook(self, module, args, output):
        if not self.active or self._inside or not isinstance(module, self.classes):
            return None
        self._inside = True  # (the repeats' own submodule calls are not repeated again)
        try:
            with torch.no_grad():
                for _ in range(self.repeat - 1):
                    module.forward(*args)
        finally:
            self._inside = False
        return None

    def on_train_start(self, trainer, pl_module):
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.active = dist.get_rank() == self.rank and self.start <= trainer.global_step < self.stop

    def on_train_end(self, trainer, pl_module):
        self.active = False
        if self._handle is not None:
            self._handle.remove()


class BusyProbe(L.Callback):
    """Per step: every pipeline rank's busy seconds as the step's all-reduce gave them."""

    def __init__(self):
        self.rank_busy: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rank_busy.append(list(trainer.strategy.pipeline.rebalancer.rank_busy))


def count_replica_averages() -> list[int]:
    """Count the strategy's data-parallel gradient averages (the real function, called through)."""
    from lightning_dynmo.runtime import dp_sharding as module

    calls, real = [0], module.average_over_replicas

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    module.average_over_replicas = counted
    return calls


class ReleaseListener(L.Callback):
    """What a launcher would do: listen for released workers."""

    def __init__(self):
        self.ranks = []

    def on_workers_released(self, ranks):
        self.ranks = list(ranks)


def _pipeline_grad_norm(trainer) -> float:
    """The whole model's gradient norm: local norms summed over the pipeline group (NaN on a
    released rank, which joins no collective)."""
    s = trainer.strategy.pipeline
    if s.released:
        return math.nan
    grads = [p.grad for p in trainer.lightning_module.parameters() if p.grad is not None]
    shards = [g for g in grads if isinstance(g, DTensor)]  # dp_sharding="fsdp": whole from the replicas' shards
    grads = [g for g in grads if not isinstance(g, DTensor)]
    local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
    sq = local.double().square().reshape(1)
    if shards:
        part = sum(g.to_local().double().square().sum() for g in shards).reshape(1)
        dist.all_reduce(part, group=s.data_parallel_group)
        sq = sq + part
    dist.all_reduce(sq, group=s.pipeline_group)
    return float(sq.sqrt())


class StepProbe(L.Callback):
    """Per step, on every rank: the whole model's gradient norm *before* clipping (local norms
    summed over the pipeline group; what ``clip_grad_norm_`` would see in one process), the
    micro-batch count the strategy used, and how many tensors autograd saved for backward on this
    rank (0: the rank built no autograd graph)."""

    def __init__(self):
        self.grad_norms: list[float] = []
        self.microbatches: list[int | None] = []
        self.saved_tensors: list[int] = []
        self._saved = 0
        self._hooks = None

        self.post_clip_norms: list[float] = []

    def on_train_start(self, trainer, pl_module):
        if trainer.gradient_clip_val and not getattr(self, "_stepping", False):
            # right after the update (a pre-hook would run before Lightning's closure): the norm
            # clipping left (the optimizers here leave .grad as it was)
            self._stepping = True
            for opt in trainer.optimizers:
                opt.register_step_post_hook(lambda *_: self.post_clip_norms.append(_pipeline_grad_norm(trainer)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._saved = 0

        def pack(t):
            self._saved += 1
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grad_norms.append(_pipeline_grad_norm(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        self.saved_tensors.append(self._saved)
        self.microbatches.append(trainer.strategy.pipeline.last_microbatches)


def _masks(module) -> tuple[int, int, int]:
    """This rank's pruning masks: how many, how many are DTensor shards, and their local elements."""
    from lightning_dynmo.dynamic import PrunableLinear

    masks = [m.weight_mask for m in module.modules() if isinstance(m, PrunableLinear) and not m.compressed]
    return (len(masks), sum(1 for b in masks if isinstance(b, DTensor)),
            sum((b.to_local() if isinstance(b, DTensor) else b).numel() for b in masks))


def _csr_layers(module) -> tuple[int, int, int]:
    """This rank's CSR-stored pruned Linears: how many, how many hold their values as DTensor
    shards, and their local values."""
    from lightning_dynmo.dynamic import PrunableLinear

    values = [m.weight for m in module.modules() if isinstance(m, PrunableLinear) and m.compressed]
    return (len(values), sum(1 for v in values if isinstance(v, DTensor)),
            sum((v.to_local() if isinstance(v, DTensor) else v).numel() for v in values))


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.get("pin_cores"):
        pin_to_own_core()
    nnodes = int(cfg.get("nnodes", 1))
    model = make_model(cfg)
    evaluate = cfg.get("evaluate")
    if evaluate:
        model = GPTWithTest(**model.hparams)  # the same seeded GPT, plus a test_step
    pp = cfg["pp"]
    dp = world // pp
    strategy = DynMoStrategy(
        pipeline_parallel=pp,
        schedule=cfg.get("schedule", "1f1b"),
        microbatches=cfg.get("microbatches", 4),  # null in the spec: None (the strategy chooses)
        virtual_stages=cfg.get("virtual_stages"),
        balancer=cfg.get("balancer", "uniform"),
        partition=cfg.get("partition"),
        rebalance=cfg.get("rebalance", "never"),
        rebalance_interval=cfg.get("rebalance_interval", 1),
        imbalance_threshold=cfg.get("imbalance_threshold", 0.1),
        repack=cfg.get("repack", "off"),
        repack_tolerance=cfg.get("repack_tolerance", 0.05),
        rebalance_horizon=cfg.get("rebalance_horizon", 100),
        memory_capacity=cfg.get("memory_capacity"),
        link_bandwidth=tuple(cfg["link_bandwidth"]) if isinstance(cfg.get("link_bandwidth"), list)
        else cfg.get("link_bandwidth"),
        rebalance_cooldown=cfg.get("rebalance_cooldown", 10),
        overhead_budget=float(cfg.get("overhead_budget", 0.01)),
        profile_steps=cfg.get("profile_steps", 1),
        rank_speeds=cfg.get("rank_speeds", False),
        plot=bool(cfg.get("plot", False)),
        timeout=cfg.get("timeout", 120),
        activation_checkpointing=cfg.get("activation_checkpointing", False),
        dp_sharding=cfg.get("dp_sharding", "replicate"),
        checkpoint_format=cfg.get("checkpoint_format", "single"),
    )
    averages = count_replica_averages()
    rec = LossRecorder()
    probe = StepProbe()
    released_hook = ReleaseListener()
    ckpt_dir = os.path.join(out_dir, f"ckpt{idx}")
    busy = BusyProbe()
    callbacks = [rec, probe, released_hook, busy]
    if cfg.get("slow"):  # {"rank", "start", "stop", "repeat"}: that rank runs the layers' forwards repeat times
        classes = tuple({type(layer) for layer in make_model(cfg).pipeline_layers()})
        callbacks.append(SlowOnRank(classes=classes, **cfg["slow"]))
    if cfg.get("freeze"):
        from lightning_dynmo import LayerFreezing

        callbacks.append(LayerFreezing(schedule={int(k): int(v) for k, v in cfg["freeze"].items()}))
    pruning = None
    if cfg.get("pruning") is not None:  # GradualPruning kwargs
        from lightning_dynmo import GradualPruning

        pruning = GradualPruning(**cfg["pruning"])
        callbacks.append(pruning)
    if cfg.get("starve"):  # [layer, submodule]
        callbacks.append(StarveOnOneReplica(int(cfg["starve"][0]), cfg["starve"][1]))
    if cfg.get("request_repack"):
        step, target = cfg["request_repack"]
        callbacks.append(RepackRequest(int(step), target))
    direct = None
    mid_window = None
    if cfg.get("mid_window_partitions"):
        mid_window = MidWindowRebalance(cfg["mid_window_partitions"])
        callbacks.append(mid_window)
    if cfg.get("repack_to"):
        direct = DirectRepack(*[int(v) for v in cfg["repack_to"]])
        callbacks.append(direct)
    monitor = None
    if cfg.get("sparse_monitor") is not None:  # SparseAttentionMonitor kwargs
        from lightning_dynmo import SparseAttentionMonitor

        monitor = SparseAttentionMonitor(**cfg["sparse_monitor"])
        callbacks.append(monitor)
    early_exit = None
    if cfg.get("early_exit") is not None:  # EarlyExit kwargs (with an early_exit_gpt model)
        from lightning_dynmo import EarlyExit

        early_exit = EarlyExit(**cfg["early_exit"])
        callbacks.append(early_exit)
    if cfg.get("save_ckpt"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True,
                                                             every_n_train_steps=cfg["steps"]))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world // nnodes,
        num_nodes=nnodes,
        max_steps=cfg["steps"],
        logger=CSVLogger(out_dir, name=f"logs{idx}") if cfg.get("logger") else False,
        log_every_n_steps=1,
        enable_checkpointing=bool(cfg.get("save_ckpt")),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=evaluate["val_batches"] if evaluate else 0,
        val_check_interval=cfg["steps"] if evaluate else None,
        gradient_clip_val=cfg.get("clip"),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        callbacks=callbacks,
        default_root_dir=os.path.join(out_dir, f"run{idx}"),  # each run's rebalance_history / cost_trace
    )
    if cfg.get("meta"):  # built on the meta device; setup materialises this rank's layers
        with trainer.init_module(empty_init=True):
            model = make_model(cfg)
        assert all(p.is_meta for p in model.parameters())
    val = eval_loader(cfg, cfg["batch"]) if evaluate else None
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"]), val_dataloaders=val,
                ckpt_path=cfg.get("resume"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    events = trainer.strategy.pipeline.last_step_events()  # the last step's chunk timeline on this rank
    chunk_seconds = {k: sum(e["end"] - e["start"] for e in events if e["kind"] == k) for k in "FBW"}
    grads = sum(1 for p in trainer.lightning_module.parameters() if p.grad is not None)
    optim_tensors = sum(1 for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
                        if torch.is_tensor(v) and v.numel() > 1)
    local_numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                      for p in trainer.lightning_module.parameters())
    frozen = [p for p in trainer.lightning_module.parameters() if not p.requires_grad]
    frozen_with_state = sum(1 for p in frozen for opt in trainer.optimizers if opt.state.get(p))
    local = (sum(p.numel() for p in trainer.lightning_module.parameters()),
             bool(trainer.strategy.pipeline.released),
             chunk_seconds, grads, optim_tensors, released_hook.ranks, probe.saved_tensors,
             list(trainer.strategy.pipeline.released_ranks), direct.returned if direct else None, local_numel,
             (len(frozen), frozen_with_state, sum(1 for p in frozen if isinstance(p, DTensor))),
             metrics.get("val_acc"), _masks(trainer.lightning_module), _csr_layers(trainer.lightning_module))
    memory = pruning.state_bytes(trainer, trainer.lightning_module) if pruning else None  # (collective)
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, local)
    # the whole model on rank 0 whatever checkpoint_format saves (under "dcp" the strategy's own hooks
    # return local shards)
    pipeline = trainer.strategy.pipeline
    state = checkpoint.full_model_state_dict(pipeline.snapshot())
    optim = checkpoint.full_optimizer_state(pipeline.snapshot(), trainer.optimizers[0])
    if pruning:  # CSR-stored weights' moments in the dense format, as a checkpoint writes them
        pruning.on_save_checkpoint(trainer, trainer.lightning_module,
                                   {"optimizer_states": [optim], "state_dict": state})
    result = {"losses": rec.losses, "step_seconds": rec.step_seconds, "imbalance": rec.imbalance,
              "history": pipeline.rebalance_history, "partition": str(pipeline.partition), "dp": dp,
              "params_per_rank": [x[0] for x in per_rank], "released_per_rank": [x[1] for x in per_rank],
              "chunk_seconds_per_rank": [x[2] for x in per_rank], "grads_per_rank": [x[3] for x in per_rank],
              "released_hook": released_hook.ranks, "optim_tensors_per_rank": [x[4] for x in per_rank],
              "released_hook_per_rank": [x[5] for x in per_rank], "saved_tensors_per_rank": [x[6] for x in per_rank],
              "strategy_released_ranks_per_rank": [x[7] for x in per_rank],
              "repack_to_returned_per_rank": [x[8] for x in per_rank],
              "local_param_numel_per_rank": [x[9] for x in per_rank],
              "frozen_per_rank": [x[10] for x in per_rank],  # (frozen params, of them with optimizer state, sharded)
              "val_acc_per_rank": [x[11] for x in per_rank],  # pipeline_eval_step's metric as each rank logged it
              "masks_per_rank": [x[12] for x in per_rank],  # pruning masks, of them DTensor shards, local elements
              "csr_per_rank": [x[13] for x in per_rank],  # CSR-stored Linears, of them sharded, local values
              "pruning": pruning.state_dict() if pruning else None,
              "pruning_memory": memory,  # GradualPruning.state_bytes: the pruned layers' state over all ranks
              "grad_norms": probe.grad_norms, "post_clip_norms": probe.post_clip_norms,
              "microbatches_per_step": probe.microbatches, "metrics": metrics,
              "log_dir": trainer.log_dir, "root_dir": trainer.default_root_dir,
              "monitor": dict(monitor.state_dict(), last_stats=monitor.last_stats) if monitor else None,
              "early_exit": early_exit.state_dict() if early_exit else None,
              "replica_averages": averages[0], "mid_window_moves": mid_window.moves if mid_window else 0,
              "rank_busy": busy.rank_busy, "summary": trainer.strategy.pipeline.dynmo_summary}
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"state{idx}.pt")
        result["optim"] = os.path.join(out_dir, f"optim{idx}.pt")
        torch.save(state, result["state"])
        torch.save(optim, result["optim"])
        if cfg.get("save_ckpt"):
            result["ckpt"] = os.path.join(ckpt_dir, "last.ckpt")
    for stage in ("test", "validate"):  # the usual Lightning flow: fit, then test/validate on the same trainer
        if not (evaluate and evaluate.get(stage)):
            continue
        try:
            out = getattr(trainer, stage)(model, dataloaders=eval_loader(cfg, cfg["batch"]), verbose=False)
            result[f"{stage}_metrics"] = out[0] if out else {}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which says what it expected
            result[f"{stage}_error"] = f"{type(exc).__name__}: {exc}"
            print(f"rank {trainer.global_rank}: trainer.{stage} failed: {result[f'{stage}_error']}", flush=True)
    return result


if __name__ == "__main__":
    run_spec(run_one)
