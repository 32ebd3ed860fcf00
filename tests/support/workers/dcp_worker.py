"""DCP checkpoints (``checkpoint_format="dcp"``) in one torchrun job: a list of runs, each a fit that
may resume from and save to a checkpoint directory, or a bad checkpoint that must fail.

Usage: torchrun --nproc-per-node N tests/support/workers/dcp_worker.py SPEC.json
A run: {"pp", "steps", "resume" (a path or "last"), "ckpt_dir" (ModelCheckpoint's dirpath, saving
last.ckpt at the last step), "tied", "damage" (how to spoil "resume" first, on rank 0), "save_memory"
(save twice after the fit, once per format, measuring rank 0's peak RSS growth), "repack_to" ([step, ranks]),
"poison_save" (a path: after the fit, a NaN into one weight of the last rank, then save there), "fsdp"
(dp_sharding="fsdp"; checkpoint_format then defaults by it unless "format" is given), "probe_load" (after the fit,
every rank loads "resume" again and reports what it read: its own entries, sharded or whole)}. Every data-parallel
layout sees the same global batches (no shuffling), so losses compare across layouts. Rank 0 writes per run its losses,
the error every rank raised (if any) and the bytes of the DCP files it saved.
"""
from __future__ import annotations

import ctypes
import os
import shutil

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

torch.set_num_threads(1)

import lightning as L

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.strategy.options import CheckpointFormat
from lightning_dynmo.strategy.checkpointer import checkpointer_for

from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec

PER_REPLICA_BATCH = 8
DP_REFERENCE = 2  # the global batch is that of 2 replicas, whatever the layout


def loader(cfg: dict, strategy) -> DataLoader:
    """The same global batches under any layout, in the same order every epoch (Lightning's epoch
    count after a resume at an epoch's last batch is off by one when that run saves again, so the
    data must not depend on it): replica r of 2 takes samples r, r + 2, ...; one replica takes both
    halves in one batch."""
    data = make_loader(cfg, 1).dataset
    kw = strategy.distributed_sampler_kwargs
    if kw["num_replicas"] == DP_REFERENCE:  # a DistributedSampler of the loader's own is kept by Lightning
        sampler = DistributedSampler(data, **kw, shuffle=False)
        return DataLoader(data, batch_size=PER_REPLICA_BATCH, sampler=sampler, drop_last=True)
    assert kw["num_replicas"] == 1
    return DataLoader(data, batch_size=PER_REPLICA_BATCH * DP_REFERENCE, shuffle=False, drop_last=True)


def distcp_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


def damage(path: str, how: str) -> str:
    """A spoilt copy of the checkpoint directory ``path`` (rank 0 writes it; every rank returns its path)."""
    out = f"{path}.{how}"
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(path, out)
        if how == "flip_shard":  # one byte inside a tensor of rank 1's shard file
            f = os.path.join(out, "__1_0.distcp")
            data = bytearray(open(f, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(f, "wb").write(bytes(data))
        elif how == "missing_shard":
            os.remove(os.path.join(out, "__0_0.distcp"))
    dist.barrier()
    return out


def peak_rss_growth(fn) -> int:
    """Bytes by which this process's peak resident set grows while ``fn`` runs (VmHWM, reset first)."""
    def hwm() -> int:
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: the peak then counts live data
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak to the current RSS
    before = hwm()
    fn()
    return hwm() - before


def probe_load(strategy, path: str) -> list[dict]:
    """Every rank's reading of ``path`` (the strategy's own load, as a resume does): how many of its
    entries came back as DTensor shards, and the elements it read against those of the whole entries."""
    from torch.distributed.tensor import DTensor

    ckpt = strategy.load_checkpoint(path)
    own = set(strategy.lightning_module.state_dict())
    read = [v for k, v in ckpt["state_dict"].items() if k in own]
    read += [v for sd in ckpt.get("optimizer_states", []) for st in sd["state"].values() for v in st.values()
             if torch.is_tensor(v) and v.device.type != "meta" and v.dim() > 0]
    shards = [v for v in read if isinstance(v, DTensor)]
    report = {"entries": len(read), "sharded": len(shards),
              "read_numel": sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel() for v in read),
              "whole_numel": sum(v.numel() for v in read)}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = cfg["pp"]
    dp = world // pp
    model = make_model(cfg)
    if cfg.get("optimizer_sgd"):
        from tests.support.workers.common import SGDGPT

        model = make_model(cfg, SGDGPT)
    fmt = cfg.get("format", None if cfg.get("fsdp") else "dcp")  # None: by dp_sharding (fsdp: dcp)
    strategy = DynMoStrategy(pipeline_parallel=pp, microbatches=4, checkpoint_format=fmt,
                             dp_sharding="fsdp" if cfg.get("fsdp") else "replicate",
                             rebalance=cfg.get("rebalance", "never"), rebalance_interval=1, balancer="uniform",
                             timeout=120, repack=cfg.get("repack", "off"))
    rec = LossRecorder()
    callbacks: list = [rec]
    if cfg.get("repack_to"):  # [step, ranks]: every layer onto the first `ranks` pipeline ranks after that step
        from tests.support.workers.pipeline_worker import DirectRepack

        callbacks.append(DirectRepack(*[int(v) for v in cfg["repack_to"]]))
    if cfg.get("ckpt_dir"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=cfg["ckpt_dir"], save_last=True,
                                                             every_n_train_steps=cfg["steps"]))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=cfg["steps"], logger=False,
                        enable_checkpointing=bool(cfg.get("ckpt_dir")), enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
                        default_root_dir=os.path.join(out_dir, f"run{idx}"))
    resume = cfg.get("resume")
    if resume and cfg.get("damage"):
        resume = damage(resume, cfg["damage"])
    error = None
    try:
        trainer.fit(model, train_dataloaders=loader(cfg, strategy), ckpt_path=resume)
    except Exception as exc:  # noqa: BLE001 - reported: the test expects it on every rank
        error = f"{type(exc).__name__}: {exc}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    result = {"losses": rec.losses, "errors": errors, "dp": dp, "partition": str(strategy.pipeline.partition),
              "released_ranks": list(strategy.pipeline.released_ranks) if strategy.pipeline.layout is not None else []}
    last = trainer.checkpoint_callback.last_model_path if cfg.get("ckpt_dir") else None
    if last and error is None:
        result["ckpt"] = last
        result["distcp_bytes"] = distcp_bytes(last) if os.path.isdir(last) else None
    if cfg.get("poison_save") and error is None:  # a NaN in one weight of the last rank, then a checkpoint of it
        if dist.get_rank() == world - 1:
            with torch.no_grad():
                next(trainer.lightning_module.parameters()).view(-1)[0] = float("nan")
        trainer.save_checkpoint(cfg["poison_save"])
    if cfg.get("probe_load") and error is None:
        result["probe_load"] = probe_load(strategy, cfg["resume"])
    if cfg.get("save_memory") and error is None:
        growth = {}
        for fmt in ("dcp", "single"):  # the control: the gathered file grows rank 0 by the whole state
            strategy.checkpointer = checkpointer_for(CheckpointFormat(fmt))  # the format, switched
            path = os.path.join(out_dir, f"memory.{fmt}")
            growth[fmt] = peak_rss_growth(lambda: trainer.save_checkpoint(path))
        state = trainer.lightning_module
        local = sum(p.numel() * p.element_size() for p in state.parameters())
        local += sum(v.numel() * v.element_size() for opt in trainer.optimizers for st in opt.state.values()
                     for v in st.values() if torch.is_tensor(v))
        totals = [None] * world
        dist.all_gather_object(totals, local)
        result.update(save_rss_growth=growth, full_state_bytes=sum(totals) // dp,
                      rank0_state_bytes=totals[0])
    return result


if __name__ == "__main__":
    run_spec(run_one)
