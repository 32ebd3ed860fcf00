"""Setup memory per rank with meta-device init, and activation memory with checkpointing.

1. **Setup peak RSS.** A GPT with 24 blocks is set up (``Trainer.fit`` until ``on_fit_start``:
   model build, process groups, optimizer, partition, materialisation, move to device) on one
   process (pp=1), on a 2-rank and on a 4-rank pipeline (torchrun, gloo). Each rank resets its
   peak-RSS high-water mark after the imports (Linux ``/proc/self/clear_refs``), builds the model
   under ``trainer.init_module(empty_init=True)`` (the meta device; the strategy materialises
   only the rank's own layers) and reports the peak RSS reached during setup minus its RSS before
   the build (the interpreter's baseline: Python, torch, Lightning). The ratios are the max over
   ranks divided by the single process's figure (``setup_peak_rss_ratio_pp2``/``_pp4``; targets
   <= 0.65 and <= 0.4). For contrast, ``setup_peak_rss_ratio_pp2_full_build``: the same 2-rank
   pipeline with the model built on real tensors (every rank holds the whole model at setup).
2. **Activation memory.** Bytes autograd keeps after the forward of one micro-batch through all
   pipeline layers, with every layer checkpointed vs none (saved-tensor hooks, distinct storages,
   parameters excluded; a checkpointed layer keeps its input): ``activation_bytes_ratio``.
3. **Head + loss memory.** Peak bytes the CPU allocator holds above its start (torch.profiler's
   memory events) during the forward and backward of the LM head and its cross-entropy on one
   micro-batch of hidden states (vocabulary 8192, or GPT-2's 50304 without ``--quick``), with one
   unchunked head and with ``GPTConfig(head_chunks=k)``: ``head_activation_ratio_4`` (4 chunks
   over 1; target <= 0.35). The chunks stream an online softmax, so only one vocabulary slice's
   logits exist at a time (models/vocab_head.py); the weight gradient counts in both.

4. **Sharded stages (``dp_sharding="fsdp"``).** A GPT of 24 blocks (width 256, or 512 without
   ``--quick``) trains one step on a pp2 x dp2 pipeline (4 ranks, gloo) with ``replicate`` and
   with ``fsdp``, and with ``replicate`` once more as the control (noise floor of the RSS figures).
   ``fsdp_state_ratio_dp2``: the largest per-rank parameter + gradient + Adam-state bytes after the
   step (a DTensor counts its local shard), fsdp over replicate (target <= 0.55). Also the peak RSS
   above the pre-build baseline of setup and of the step (HWM reset between them), per mode.
   The same pair on two more models: ``fsdp_state_ratio_dp2_pruned``, the GPT pruned to 90 % at
   the measured step by ``GradualPruning`` (both modes CSR-store the layers below 50 % density;
   fsdp shards the CSR values, their gradients and moments over the replicas and keeps the int32
   pattern whole on each: target <= 0.55; ``fsdp_state_ratio_dp2_pruned_with_index`` counts the
   pattern and mask buffers too); and an MoE GPT (``MOE``) with ``expert_parallel=2``:
   ``fsdp_dense_state_ratio_moe_ep2`` for the non-expert parameters (target <= 0.55) and
   ``fsdp_expert_state_ratio_moe_ep2`` for the experts, which fsdp leaves to expert parallelism
   (about 1.0). The pruned GPT is built on the meta device like the dense one; the MoE GPT on
   real tensors (its experts have no meta-device init).

Usage: python benchmarks/memory.py [--quick]      (one JSON object on the last line)
       python benchmarks/memory.py --smoke      (seconds: width 64, parts 1-3 on pp1 and pp2 only;
                                                 part 4 and pp4 need 4 ranks and are left out)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path


import torch

from _harness import launch, write_result

BLOCKS = 24
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``;
#: the full run adds the ``fsdp_*`` keys of part 4)
RESULT_KEYS = ("benchmark", "blocks", "n_embd", "model_mib_fp32", "setup_peak_mib", "setup_peak_rss_ratio_pp2",
               "setup_peak_rss_ratio_pp4", "setup_peak_rss_ratio_pp2_full_build", "activation_bytes_ratio",
               "head_activation_ratio_2", "head_activation_ratio_4", "peak_reset", "targets")


def model_config(width: int, block: int):
    from lightning_dynmo.models import GPTConfig

    return GPTConfig(vocab_size=256, block_size=block, n_layer=BLOCKS, n_head=8, n_embd=width)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def worker(args) -> None:
    torch.set_num_threads(1)
    import lightning as L
    import torch.distributed as dist

    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.models import GPT

    class StopAtFitStart(L.Callback):
        """Records the peak RSS at the end of setup and stops before the first step."""

        def on_fit_start(self, trainer, pl_module):
            self.peak_kb = _rss_kb("VmHWM") if self.reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.local_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
            trainer.should_stop = True

    world = int(os.environ.get("WORLD_SIZE", "1"))
    stop = StopAtFitStart()
    logs = tempfile.TemporaryDirectory(prefix="dynmo_bench_")  # whatever the strategy logs: not the cwd
    trainer = L.Trainer(
        strategy=DynMoStrategy(pipeline_parallel=world, microbatches=2 * world, plot=False, timeout=600),
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[stop],
        default_root_dir=logs.name,
    )
    import gc

    gc.collect()
    baseline_kb = _rss_kb("VmRSS")
    stop.reset = _reset_peak()
    t0 = time.perf_counter()
    cfg = model_config(args.width, 16)
    if args.meta:
        with trainer.init_module(empty_init=True):
            model = GPT(cfg, seed=0)
    else:
        model = GPT(cfg, seed=0)
    data = torch.randint(0, 256, (8 * world, 17))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]),
                                         batch_size=2 * world)
    trainer.fit(model, train_dataloaders=loader)
    local = {"setup_kb": stop.peak_kb - baseline_kb, "baseline_kb": baseline_kb, "params_bytes": stop.local_bytes,
             "seconds": time.perf_counter() - t0}
    per_rank = [local]
    if dist.is_initialized() and world > 1:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, local)
    logs.cleanup()
    write_result(args.out, {"ranks": per_rank, "hwm_reset": stop.reset})


def state_bytes(module, optimizers, keep=None) -> tuple[int, int, int]:
    """This rank's (parameter, gradient, optimizer-state) bytes of the parameters ``keep(p)``
    selects (default: all); a DTensor counts its local shard."""
    from lightning_dynmo.runtime.memory import local_nbytes

    params = [p for p in module.parameters() if keep is None or keep(p)]
    grads = sum(local_nbytes(p.grad) for p in params if p.grad is not None)
    optim = sum(local_nbytes(v) for opt in optimizers for p in params for v in opt.state.get(p, {}).values()
                if torch.is_tensor(v))
    return sum(local_nbytes(p) for p in params), grads, optim


#: part 4's MoE GPT: every second block MoE (4 experts, top-2), experts split by expert_parallel=2
MOE = dict(num_experts=4, top_k=2, moe_every=2)


def variant_callbacks(variant: str) -> list:
    """Part 4's callbacks: ``pruned`` prunes to 90 % at the measured step (initial = final
    sparsity: step 0 prunes straight there and trains the new masks); below 50 % density a layer is
    CSR-stored where the mode allows it. Kernels stay dense: the bytes do not depend on them."""
    from lightning_dynmo.callbacks import GradualPruning

    if variant != "pruned":
        return []
    return [GradualPruning(final_sparsity=0.9, initial_sparsity=0.9, start_step=0, n_steps=1, frequency=1,
                           sparse_kernels=False, storage_density=0.5)]


def variant_model(variant: str, width: int, trainer):
    """Part 4's model: the dense and the pruned GPT on the meta device (the pruning masks are made
    there too, by the callback's setup); the MoE GPT on real tensors (its experts have no
    meta-device init)."""
    from lightning_dynmo.models import GPT, MoEGPT

    if variant == "moe":
        return MoEGPT(model_config(width, 16), moe=MOE, seed=0)
    with trainer.init_module(empty_init=True):
        return GPT(model_config(width, 16), seed=0)


def sharding_worker(args) -> None:
    """One training step on pp2 x dp2 with ``dp_sharding=args.sharding`` on ``args.variant``: state
    bytes after the step (MoE: dense and expert parameters apart), peak RSS of setup and of the
    step (each above the pre-build RSS)."""
    torch.set_num_threads(1)
    import gc

    import lightning as L
    import torch.distributed as dist

    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.dynamic import PrunableLinear
    from lightning_dynmo.runtime.expert_parallel import expert_modules
    from lightning_dynmo.runtime.memory import local_nbytes

    class Probe(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            self.setup_kb = _rss_kb("VmHWM")
            self.reset = _reset_peak()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step_kb = _rss_kb("VmHWM")
            experts = {id(p) for _, m in expert_modules(pl_module) for p in m.parameters()}
            self.state = state_bytes(pl_module, trainer.optimizers)
            self.dense = state_bytes(pl_module, trainer.optimizers, lambda p: id(p) not in experts)
            self.experts = state_bytes(pl_module, trainer.optimizers, lambda p: id(p) in experts)
            prunable = [m for m in pl_module.modules() if isinstance(m, PrunableLinear)]
            self.prunable = len(prunable)
            self.csr = sum(1 for m in prunable if m.compressed)
            self.buffers = sum(local_nbytes(b) for m in prunable for b in m.buffers(recurse=False))

    world = int(os.environ.get("WORLD_SIZE", "1"))
    probe = Probe()
    logs = tempfile.TemporaryDirectory(prefix="dynmo_bench_")
    ep = 2 if args.variant == "moe" else 1
    callbacks = variant_callbacks(args.variant)
    trainer = L.Trainer(
        strategy=DynMoStrategy(pipeline_parallel=2, microbatches=4, plot=False, timeout=600, dp_sharding=args.sharding,
                               expert_parallel=ep),
        accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[*callbacks, probe],
        default_root_dir=logs.name,
    )
    gc.collect()
    baseline_kb = _rss_kb("VmRSS")
    reset = _reset_peak()
    model = variant_model(args.variant, args.width, trainer)
    data = torch.randint(0, 256, (8 * world, 17), generator=torch.Generator().manual_seed(0))  # same on every rank
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8)
    trainer.fit(model, train_dataloaders=loader)
    local = {"setup_kb": probe.setup_kb - baseline_kb, "step_kb": probe.step_kb - baseline_kb,
             "param_bytes": probe.state[0], "grad_bytes": probe.state[1], "optim_bytes": probe.state[2],
             "dense_state_bytes": sum(probe.dense), "expert_state_bytes": sum(probe.experts),
             "prunable_layers": probe.prunable, "csr_layers": probe.csr, "mask_index_bytes": probe.buffers,
             "sparsity": round(callbacks[0].sparsity, 4) if callbacks else 0.0}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, local)
    logs.cleanup()
    write_result(args.out, {"ranks": per_rank, "hwm_reset": reset and probe.reset})


def sharding_runs(width: int) -> dict:
    """Replicate, fsdp and the replicate control on the dense GPT, then both modes on the pruned
    GPT and on the MoE GPT (expert_parallel=2), each on 4 ranks; the figures and ratios."""
    runs = {}
    jobs = (("pruned_replicate", "replicate", "pruned"), ("pruned_fsdp", "fsdp", "pruned"),
            ("moe_replicate", "replicate", "moe"), ("moe_fsdp", "fsdp", "moe"),
            ("replicate", "replicate", "dense"), ("fsdp", "fsdp", "dense"), ("replicate_control", "replicate", "dense"))
    for name, mode, variant in jobs:
        res = launch(Path(__file__), 4, ["--sharding", mode, "--variant", variant, "--width", str(width)])
        for r in res["ranks"]:
            r["state_bytes"] = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
            r["state_and_index"] = r["state_bytes"] + r["mask_index_bytes"]
        runs[name] = res
        print(f"{name}: per-rank parameter+gradient+optimizer MiB "
              f"{[round(r['state_bytes'] / 2**20, 1) for r in res['ranks']]}, setup peak RSS MiB "
              f"{[round(r['setup_kb'] / 1024, 1) for r in res['ranks']]}, step peak RSS MiB "
              f"{[round(r['step_kb'] / 1024, 1) for r in res['ranks']]}"
              + (f", CSR-stored layers {[r['csr_layers'] for r in res['ranks']]} of "
                 f"{[r['prunable_layers'] for r in res['ranks']]}" if variant == "pruned" else "")
              + (f", dense / expert MiB {[round(r['dense_state_bytes'] / 2**20, 1) for r in res['ranks']]} / "
                 f"{[round(r['expert_state_bytes'] / 2**20, 1) for r in res['ranks']]}" if variant == "moe" else ""),
              flush=True)

    def worst(name: str, key: str) -> float:
        return max(r[key] for r in runs[name]["ranks"])

    def mib(names, key="state_bytes"):
        return {n: [round(r[key] / 2**20, 2) for r in runs[n]["ranks"]] for n in names}

    return {
        "fsdp_width": width,
        "fsdp_state_ratio_dp2": round(worst("fsdp", "state_bytes") / worst("replicate", "state_bytes"), 4),
        "fsdp_state_mib_per_rank": mib(("replicate", "fsdp")),
        "fsdp_grads_present": all(r["grad_bytes"] > 0 for n in runs for r in runs[n]["ranks"]),
        "fsdp_setup_peak_mib": {n: [round(r["setup_kb"] / 1024, 1) for r in runs[n]["ranks"]] for n in runs},
        "fsdp_step_peak_mib": {n: [round(r["step_kb"] / 1024, 1) for r in runs[n]["ranks"]] for n in runs},
        "fsdp_setup_peak_ratio": round(worst("fsdp", "setup_kb") / worst("replicate", "setup_kb"), 3),
        "fsdp_step_peak_ratio": round(worst("fsdp", "step_kb") / worst("replicate", "step_kb"), 3),
        # the noise floor: the same replicate configuration twice
        "fsdp_control_setup_peak_ratio":
            round(worst("replicate_control", "setup_kb") / worst("replicate", "setup_kb"), 3),
        "fsdp_control_step_peak_ratio": round(worst("replicate_control", "step_kb") / worst("replicate", "step_kb"), 3),
        "fsdp_peak_reset": all(runs[n]["hwm_reset"] for n in runs),
        # pruned to 90 %: both CSR-store the sparse layers; fsdp shards the values, not the pattern
        "fsdp_state_ratio_dp2_pruned":
            round(worst("pruned_fsdp", "state_bytes") / worst("pruned_replicate", "state_bytes"), 4),
        "fsdp_state_ratio_dp2_pruned_with_index":
            round(worst("pruned_fsdp", "state_and_index") / worst("pruned_replicate", "state_and_index"), 4),
        "fsdp_pruned_state_mib_per_rank": mib(("pruned_replicate", "pruned_fsdp")),
        "fsdp_pruned_mask_index_mib_per_rank": mib(("pruned_replicate", "pruned_fsdp"), "mask_index_bytes"),
        "fsdp_pruned_csr_layers_per_rank": {n: [r["csr_layers"] for r in runs[n]["ranks"]]
                                            for n in ("pruned_replicate", "pruned_fsdp")},
        "fsdp_pruned_prunable_layers_per_rank": [r["prunable_layers"] for r in runs["pruned_fsdp"]["ranks"]],
        "fsdp_pruned_sparsity": {n: runs[n]["ranks"][0]["sparsity"] for n in ("pruned_replicate", "pruned_fsdp")},
        # MoE, expert_parallel=2: the dense parameters are sharded by fsdp, the experts by expert parallelism only
        "fsdp_dense_state_ratio_moe_ep2":
            round(worst("moe_fsdp", "dense_state_bytes") / worst("moe_replicate", "dense_state_bytes"), 4),
        "fsdp_expert_state_ratio_moe_ep2":
            round(worst("moe_fsdp", "expert_state_bytes") / worst("moe_replicate", "expert_state_bytes"), 4),
        "fsdp_moe_dense_state_mib_per_rank": mib(("moe_replicate", "moe_fsdp"), "dense_state_bytes"),
        "fsdp_moe_expert_state_mib_per_rank": mib(("moe_replicate", "moe_fsdp"), "expert_state_bytes"),
        "fsdp_moe": MOE,
    }


#: part 4's targets
SHARDING_TARGETS = {"fsdp_state_ratio_dp2": 0.55, "fsdp_state_ratio_dp2_pruned": 0.55,
                    "fsdp_dense_state_ratio_moe_ep2": 0.55}


def activation_bytes(width: int, block: int, microbatch: int) -> tuple[int, int]:
    """Saved-activation bytes of one micro-batch through every pipeline layer, plain and with
    every layer checkpointed."""
    from torch import nn

    from lightning_dynmo.models import GPT
    from lightning_dynmo.runtime.recompute import CheckpointedLayer, saved_activation_bytes

    model = GPT(model_config(width, block), seed=0)
    layers = list(model.pipeline_layers())
    x = torch.randint(0, 256, (microbatch, block))
    plain = saved_activation_bytes(nn.Sequential(*layers), x)
    ckpt = saved_activation_bytes(nn.Sequential(*[CheckpointedLayer(l, i) for i, l in enumerate(layers)]), x)
    return plain, ckpt


def _allocator_peak(fn) -> int:
    """Peak bytes allocated on the CPU above the level at the start, while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted((e.time_range.end, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                    for e in prof.events())
    level = peak = 0
    for _, d in deltas:
        level += d
        peak = max(peak, level)
    return peak


def head_activation_peak(chunks: int, width: int, vocab: int, block: int, microbatch: int) -> int:
    """Peak bytes of the head + loss forward and backward on one micro-batch (see the docstring)."""
    from lightning_dynmo.models import GPT, GPTConfig
    from lightning_dynmo.protocol.activations import run_layers

    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=1, n_head=8, n_embd=width, head_chunks=chunks)
    model = GPT(cfg, seed=0)
    head = model.pipeline_layers()[model.head_index:]
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(microbatch, block, width, generator=gen).requires_grad_()
    y = torch.randint(0, vocab, (microbatch, block), generator=gen)

    def step() -> None:
        out = run_layers(head, (h,) if chunks == 1 else (h, y))  # what reaches the head
        model.pipeline_loss(out, y).backward()

    step()  # warm-up: lazily allocated buffers do not count
    h.grad = None
    for p in model.parameters():
        p.grad = None
    return _allocator_peak(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="width 512 (76M parameters) instead of 768 (170M)")
    parser.add_argument("--smoke", action="store_true",
                        help="width 64, pp1 and pp2 only, no part 4: checks that the script runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--meta", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=768, help=argparse.SUPPRESS)
    parser.add_argument("--sharding", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="dense", help=argparse.SUPPRESS)
    parser.add_argument("--only-sharding", action="store_true", help="only part 4 (dp_sharding replicate vs fsdp)")
    args = parser.parse_args()
    if args.worker:
        sharding_worker(args) if args.sharding else worker(args)
        return
    if args.only_sharding:
        sharding = sharding_runs(256 if args.quick else 512)
        print(json.dumps({"benchmark": "memory", "quick": bool(args.quick), **sharding,
                          "targets": SHARDING_TARGETS}))
        return
    width = 64 if args.smoke else 512 if args.quick else 768
    runs = {}
    setups = (("pp1", 1, 1), ("pp2", 2, 1), ("pp4", 4, 1), ("pp2_full_build", 2, 0))
    for name, nproc, meta in setups[:2] if args.smoke else setups:
        res = launch(Path(__file__), nproc, ["--width", str(width), "--meta", str(meta)])
        runs[name] = res
        worst = max(r["setup_kb"] for r in res["ranks"])
        print(f"{name}: setup peak RSS above baseline per rank (MiB) "
              f"{[round(r['setup_kb'] / 1024, 1) for r in res['ranks']]}, max {worst / 1024:.1f}; "
              f"parameters held {[round(r['params_bytes'] / 2**20, 1) for r in res['ranks']]} MiB", flush=True)
    single = runs["pp1"]["ranks"][0]["setup_kb"]
    ratio = {name: max(r["setup_kb"] for r in runs[name]["ranks"]) / single if name in runs else None
             for name in ("pp2", "pp4", "pp2_full_build")}
    block, microbatch = (32, 2) if args.smoke else (128, 2) if args.quick else (256, 4)
    plain, ckpt = activation_bytes(width, block, microbatch)
    print(f"activations of one micro-batch ({microbatch} x {block} tokens) through {BLOCKS + 3} layers: "
          f"{plain / 2**20:.1f} MiB plain, {ckpt / 2**20:.1f} MiB with every layer checkpointed", flush=True)
    vocab, head_block, head_mb = (512, 64, 2) if args.smoke else (8192, 512, 4) if args.quick else (50304, 1024, 4)
    sharding = {} if args.smoke else sharding_runs(256 if args.quick else 512)
    head_peak = {k: head_activation_peak(k, width, vocab, head_block, head_mb) for k in (1, 2, 4)}
    print(f"head + loss peak over one micro-batch ({head_mb} x {head_block} tokens, vocabulary {vocab}): "
          + ", ".join(f"{k} chunk(s) {b / 2**20:.1f} MiB" for k, b in head_peak.items()), flush=True)
    result = {
        "benchmark": "memory",
        "quick": bool(args.quick),
        "smoke": bool(args.smoke),
        "blocks": BLOCKS,
        "n_embd": width,
        "model_mib_fp32": round(runs["pp1"]["ranks"][0]["params_bytes"] / 2**20, 1),
        "setup_peak_mib": {name: [round(r["setup_kb"] / 1024, 1) for r in res["ranks"]] for name, res in runs.items()},
        **{f"setup_peak_rss_ratio_{k}": None if v is None else round(v, 3) for k, v in ratio.items()},
        "targets": {"setup_peak_rss_ratio_pp2": 0.65, "setup_peak_rss_ratio_pp4": 0.4, "head_activation_ratio_4": 0.35,
                    **SHARDING_TARGETS},
        "activation_bytes_plain": plain,
        "activation_bytes_checkpointed": ckpt,
        "activation_bytes_ratio": round(ckpt / plain, 4),
        "head_vocab_size": vocab,
        "head_activation_peak_bytes": {str(k): b for k, b in head_peak.items()},
        "head_activation_ratio_2": round(head_peak[2] / head_peak[1], 4),
        "head_activation_ratio_4": round(head_peak[4] / head_peak[1], 4),
        "peak_reset": all(res["hwm_reset"] for res in runs.values()),
        **sharding,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
