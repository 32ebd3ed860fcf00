"""Meta-device init, mixed precision, activation checkpointing and Hugging Face models under the
pipeline, in one torchrun launch (see tests/distributed/test_real_models.py).

Usage: torchrun --nproc-per-node N real_models_worker.py SPEC.json
           runs every config of SPEC; rank 0 writes {"runs": [...]} (see ``run_one``)
       torchrun --nproc-per-node 2 real_models_worker.py --bad CASES OUT
           bad-input cases (comma-separated names of ``BAD``); every rank writes its errors to
           OUT.rank<r>.json
"""
from __future__ import annotations

import os
import sys

import torch
import lightning as L
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_dynmo import DynMoStrategy

from tests.support.workers.common import LossRecorder, NoProtocol, make_loader, make_model, record_errors, run_spec


def build_model(cfg: dict):
    """The test GPT (tests.support.workers.common) or, with ``cfg["hf"]``, the Hugging Face model
    saved in that directory (``cfg["hf_kwargs"]``: more ``HFCausalLM`` arguments)."""
    if cfg.get("hf"):
        from lightning_dynmo.models.hf import HFCausalLM

        return HFCausalLM.from_pretrained(cfg["hf"], lr=cfg.get("lr", 3e-3), warmup_steps=2, max_steps=20,
                                          **cfg.get("hf_kwargs", {}))
    return make_model(cfg)


def precision_kwargs(cfg: dict) -> dict:
    """Trainer arguments for ``cfg["precision"]``. Lightning turns "16-mixed" on CPU into
    bf16-mixed, so fp16 AMP with a grad scaler is passed as an explicit plugin."""
    precision = cfg.get("precision", "32-true")
    if precision == "16-mixed":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    if precision == "fsdp-bf16-mixed":  # an FSDP precision plugin, which Lightning accepts with any strategy
        from lightning.pytorch.plugins.precision import FSDPPrecision

        return {"plugins": [FSDPPrecision("bf16-mixed")]}
    return {"precision": precision}


class InfGradient(L.Callback):
    """At step ``step``, sets one gradient entry of parameter ``name`` to inf (on the rank that
    holds it; single process: always), before the scaler's inf check."""

    def __init__(self, step: int, name: str, replica: int | None = None):
        self.step, self.name, self.replica = step, name, replica  # replica: on that data-parallel replica only

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            p = dict(pl_module.named_parameters()).get(self.name)
            if p is not None and p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # an FSDP shard: its local piece
                if self.replica is None or self.replica == trainer.strategy.pipeline.topology.dp_rank(
                        trainer.global_rank):
                    if grad.numel():
                        grad.view(-1)[0] = float("inf")


class ScaleRecorder(L.Callback):
    def __init__(self):
        self.scales = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else None)


class InitialState(L.Callback):
    """The full model state at the start of training (a collective under the pipeline)."""

    def __init__(self, path: str):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        state = trainer.strategy.lightning_module_state_dict()
        if trainer.global_rank == 0:
            torch.save(state, self.path)


def trainer_for(cfg: dict, callbacks: list, out_dir: str) -> L.Trainer:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = DynMoStrategy(
        pipeline_parallel=cfg.get("pp", 2), schedule=cfg.get("schedule", "1f1b"),
        microbatches=cfg.get("microbatches", 4),
        balancer=cfg.get("balancer", "uniform"), rebalance=cfg.get("rebalance", "never"), rebalance_interval=1,
        partition=cfg.get("partition"), memory_capacity=cfg.get("memory_capacity"),
        activation_checkpointing=cfg.get("checkpointing", False), plot=False, timeout=120,
        dp_sharding=cfg.get("dp_sharding", "replicate"), checkpoint_format=cfg.get("checkpoint_format"),
    )
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        gradient_clip_val=cfg.get("clip"), callbacks=callbacks, default_root_dir=out_dir, **precision_kwargs(cfg),
    )


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    rec, scales = LossRecorder(), ScaleRecorder()
    init_path = os.path.join(out_dir, f"init{idx}.pt")
    callbacks = [rec, scales, InitialState(init_path)]
    if cfg.get("inf_at"):
        callbacks.append(InfGradient(*cfg["inf_at"], replica=cfg.get("inf_replica")))
    trainer = trainer_for(cfg, callbacks, out_dir)
    if cfg.get("meta"):
        with trainer.init_module(empty_init=True):
            model = build_model(cfg)
        assert all(p.is_meta for p in model.parameters())
    else:
        model = build_model(cfg)
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"]))
    strategy = trainer.strategy
    ckpt = strategy.pipeline.engines.checkpointing
    local = {"recompute": sorted(i for d in ckpt.decisions.values() for i in d),
             "layers": strategy.pipeline.local_layer_indices(), "scales": scales.scales}
    per_rank = [None] * strategy.world_size
    torch.distributed.all_gather_object(per_rank, local)
    state = strategy.lightning_module_state_dict()
    result = {"losses": rec.losses, "scales": scales.scales, "partition": str(strategy.pipeline.partition),
              "applied": sum(1 for r in strategy.pipeline.rebalance_history if r.get("applied")), "per_rank": per_rank}
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"state{idx}.pt")
        result["init"] = init_path
        torch.save(state, result["state"])
    return result


# ------------------------------------------------------------------ bad input
def _fit(model_fn, **kw) -> None:
    cfg = {"steps": 2, "batch": 8, "n_layer": 2, **kw.pop("cfg", {})}
    cfg.update(kw)
    trainer = trainer_for(cfg, [], os.getcwd())
    trainer.fit(model_fn(cfg), train_dataloaders=make_loader(cfg, cfg["batch"]))


def _hf(path_key: str):
    def fn(cfg):
        from lightning_dynmo.models.hf import HFCausalLM

        return HFCausalLM.from_pretrained(os.environ[path_key])
    return fn


BAD = {
    "hf_unknown_architecture": lambda: _fit(_hf("DYNMO_TEST_HF_UNKNOWN")),
    "hf_shape_mismatch": lambda: _fit(_hf("DYNMO_TEST_HF_MISMATCH")),
    "precision_unsupported": lambda: _fit(make_model, precision="fsdp-bf16-mixed"),
    "checkpointing_without_protocol": lambda: _fit(lambda cfg: NoProtocol(16, 64), checkpointing=True),
    "checkpointing_auto_without_capacity": lambda: _fit(make_model, checkpointing="auto"),
}


def run_bad(names: list[str], out: str) -> None:
    record_errors(lambda name: BAD[name](), names, out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "--bad":
        run_bad(sys.argv[2].split(","), sys.argv[3])
    else:
        run_spec(run_one)
