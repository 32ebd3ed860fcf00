"""Gradual global magnitude pruning in continual training, as DynMo runs it (Zhu & Gupta to 90 %).

**Trained start point.** Global magnitude pruning of a freshly initialised GPT keeps equal
blocks at equal densities (nothing to balance); the paper prunes a *trained* model. So the
benchmark first trains the dense model (the warm-up phase, ``WARMUP``: single process, AdamW,
on three-byte tokens of the standard library's help text, ``lightning_dynmo.data.text``) and
writes that checkpoint once (cached under the temp dir, keyed by everything that determines it);
every configuration then starts from it and continues training on the same text. The dynamic
phase runs a few dense steps (a fresh optimizer settles), then prunes every ``dt`` steps on the
cubic schedule to 52 %, 79 %, 89 % and 90 % global sparsity over the blocks' Linear weights (the
embedding, final norm and LM head stay dense, as usual). Layers take whatever density global
magnitude pruning of the trained weights leaves them, reported per layer: later blocks come out
denser than early ones. Below 50 % density a layer is CSR-stored (its master weight is the kept
values: gradients and Adam moments shrink with it) and the sparse kernel computes it where the
measured crossover says it is faster.

**Model shape.** 8 blocks of hidden 192, vocabulary 4608 (the 4607 most frequent three-byte
chunks of the corpus, 96 % of it, plus one id for the rest). The LM head is then ~1.8 dense
blocks of compute (forward + backward + cross-entropy), the proportion of GPT pipelines (GPT-2
small: ~5 blocks of 12; the paper's hidden-1024 GPT: ~4 of 24), so the layer-count split
(embedding + 5 blocks | 3 blocks + norm + head) balances the *dense* model and the dynamic run
starts from it too. Parameters: embedding 0.90 M, blocks 3.55 M, head 0.88 M; the dense
embedding and head are a third of the gradient bytes, which bounds the data-parallel exchange
ratio from below at ~0.35 whatever the blocks' sparsity (the paper's hidden-1024 GPT with 24
layers: 0.33, with 56 layers: 0.21).

The measurement window is the whole dynamic phase: from the first pruning step (52 %) to the
end, including the profiled steps and migrations. The dynamic run also has ``repack="auto"``
(DynPipe's Algorithm 1: after each rebalance, pack onto fewer ranks if throughput holds);
``ranks_over_time`` reports the pipeline width after each decision.

``launcher_extra`` (run by the launcher, 4 ranks: pp=2 x dp=2) measures the data-parallel gradient
exchange on the same model and start point: bytes handed to the data-parallel all-reduce per step
on the dense model vs after pruning to 90 % (CSR-stored layers exchange only kept values).
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile

MODEL = dict(vocab_size=4608, block_size=64, n_layer=8, n_head=4, n_embd=192, dropout=0.0)
NUM_LAYERS = MODEL["n_layer"] + 3  # pipeline layers: embedding, blocks, final norm, head
TOKEN_BYTES = 3
# dense pre-training that produces the continual-training start point (~300 single-process steps)
WARMUP = dict(steps=300, lr=3e-3, warmup_steps=10, batch=16, weight_decay=0.1, seed=0)


# ------------------------------------------------------------------------------ data and warm-up
def _tokens(vocab_size: int):
    """The corpus as ``TOKEN_BYTES``-byte tokens: the ``vocab_size - 1`` most frequent chunks get
    ids by rank, every other chunk the last id."""
    import torch

    from lightning_dynmo.data.text import default_text_bytes

    text = default_text_bytes()
    chunks = [text[i:i + TOKEN_BYTES] for i in range(0, len(text) - TOKEN_BYTES + 1, TOKEN_BYTES)]
    ranked = sorted(collections.Counter(chunks).items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 1]
    ids = {chunk: i for i, (chunk, _) in enumerate(ranked)}
    return torch.tensor([ids.get(c, vocab_size - 1) for c in chunks], dtype=torch.long)


def data(cfg, n: int):
    """``n`` sequences of ``block_size + 1`` tokens for the dynamic phase: consecutive windows of
    the corpus (the warm-up samples random windows of the same text)."""
    tokens = _tokens(cfg.vocab_size)
    w = cfg.block_size + 1
    starts = [(i * w) % (len(tokens) - w) for i in range(n)]
    import torch

    return torch.stack([tokens[s:s + w] for s in starts])


def _warmup_path(cfg) -> str:
    import torch

    key = json.dumps([cfg.to_dict(), WARMUP, TOKEN_BYTES, torch.__version__, sys.version_info[:2]], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"dynmo_pruning_warmup_{digest}.pt")


def trained_state(cfg) -> dict:
    """The dense warm-up checkpoint's model state, trained on first use and cached; a file lock
    makes concurrent ranks train it once."""
    import torch

    path = _warmup_path(cfg)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            state = _train_dense(cfg)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
    return torch.load(path, weights_only=True)


def _train_dense(cfg) -> dict:
    """``WARMUP["steps"]`` AdamW steps on random windows of the corpus (linear LR warm-up, then
    constant), single process; returns the model's state dict."""
    import torch

    from lightning_dynmo.models import GPT

    w = WARMUP
    model = GPT(cfg, seed=w["seed"], lr=w["lr"], warmup_steps=w["warmup_steps"], max_steps=-1,
                weight_decay=w["weight_decay"])
    opt = model.configure_optimizers()
    optimizer, schedule = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    tokens = _tokens(cfg.vocab_size)
    gen = torch.Generator().manual_seed(w["seed"])
    T = cfg.block_size
    for _ in range(w["steps"]):
        starts = torch.randint(0, len(tokens) - T - 1, (w["batch"],), generator=gen)
        xy = torch.stack([tokens[s:s + T + 1] for s in starts.tolist()])
        loss = model.pipeline_loss(model(xy[:, :-1]), xy[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return model.state_dict()


# ------------------------------------------------------------------------------ the case
def plan(quick: bool) -> dict:
    warmup, dt = (3, 3) if quick else (4, 5)
    steps, rounds = (36, 1) if quick else (80, 3)
    batch, microbatches = 16, 4
    first = warmup + dt  # t0 = warmup prunes 0 % (s_i); the first real pruning step (52 %)
    return dict(steps=steps, window=(first, steps), rounds=rounds, event=first, batch=batch,
                microbatches=microbatches, model=MODEL,
                callback=dict(final_sparsity=0.9, initial_sparsity=0.0, start_step=warmup, n_steps=4, frequency=dt,
                              sparse_kernels="auto", kernel_tokens=batch // microbatches * MODEL["block_size"],
                              storage_density=0.5))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import GradualPruning
    from lightning_dynmo.models import GPT

    model = GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"])
    model.load_state_dict(trained_state(cfg))  # continual training from the dense warm-up checkpoint
    return model, [GradualPruning(**plan["callback"])]


def dynmo_strategy(plan: dict) -> dict:
    # DynMo's Algorithm 1: each pruning step requests a profiled rebalance (no periodic or automatic
    # re-decisions: on this loaded machine two near-equal partitions would trade places on noise)
    # each decision on per-layer means over 3 profiled steps: on one step they flip-flopped
    from lightning_dynmo.plan.balancers import megatron_layout

    uniform = list(megatron_layout(NUM_LAYERS, plan.get("stages", 2)).boundaries)  # dynmo starts where uniform is
    return dict(balancer="partition_time", rebalance="on_event", repack="auto", partition=uniform, profile_steps=3)


def extra(model, callbacks, strategy) -> dict:
    """Collective (every rank calls it): the memory figure sums over the pipeline."""
    from lightning_dynmo.dynamic import PrunableLinear

    cb = callbacks[0]
    trainer = model.trainer
    mem = cb.state_bytes(trainer, model)
    ranks = {"0": strategy.pipeline.topology.pp}
    for h in strategy.pipeline.rebalance_history:
        if h.get("kind") == "repack":
            ranks[str(h["step"])] = h.get("ranks_after") if h.get("applied") else h.get("ranks_before")
    return {
        "sparsity": round(cb.sparsity, 4),
        "sparsity_steps": {str(h["step"]): round(h["sparsity"], 4) for h in cb.history if h["sparsity"] > 0},
        "layer_densities": {str(h["step"]): {k: round(v, 4) for k, v in h["densities"].items()}
                            for h in cb.history if h["sparsity"] > 0},
        "pruned_state_bytes_ratio": round(mem["ratio"], 4),
        "pruned_state_bytes_ratio_with_index": round(mem["ratio_with_index"], 4),
        "csr_stored_layers_rank0": sum(1 for m in model.modules() if isinstance(m, PrunableLinear) and m.compressed),
        "sparse_kernel_layers_rank0": sum(1 for m in model.modules() if getattr(m, "sparse_kernel", False)),
        "ranks_over_time": ranks,
        "repack_decisions": {str(h["step"]): h.get("why") for h in strategy.pipeline.rebalance_history
                             if h.get("kind") == "repack"},
    }


# ------------------------------------------------------------------------------ dp exchange (4 ranks)
DP_STEPS = dict(warmup=2, dt=1, steps=8)  # prunes at 3, 4, 5, 6 (52 / 79 / 89 / 90 %)


def launcher_extra(quick: bool) -> dict:
    """Launcher side: a pp=2 x dp=2 torchrun job; returns ``dp_grad_bytes_*`` figures."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dp.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
               os.path.abspath(__file__), out]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"dp_exchange_error": (proc.stdout[-1000:] + proc.stderr[-3000:])}
        return json.load(open(out))


def _dp_worker(out: str) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.callbacks import GradualPruning
    from lightning_dynmo.dynamic import PrunableLinear
    from lightning_dynmo.models import GPT, GPTConfig

    cfg = GPTConfig(**MODEL)
    s = DP_STEPS
    strategy = DynMoStrategy(pipeline_parallel=2, microbatches=4, plot=False, timeout=300)
    sent: list[int] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is not None and group is strategy.pipeline.data_parallel_group:
            sent[-1] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    class Count(L.Callback):
        """Per step: bytes this rank handed to the data-parallel all-reduce, the bytes of its
        gradients (what the exchange must carry), and those of the pruned layers' gradients."""

        def __init__(self):
            self.bytes, self.grads, self.pruned = [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sent.append(0)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            def nbytes(ps):
                return sum(p.grad.numel() * p.grad.element_size() for p in ps if p.grad is not None)

            self.grads.append(nbytes(pl_module.parameters()))
            self.pruned.append(nbytes(p for m in pl_module.modules() if isinstance(m, PrunableLinear)
                                      for p in m.parameters()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.bytes.append(sent[-1])

    dist.all_reduce = counting_all_reduce
    seqs = data(cfg, 4 * 16 * s["steps"])
    ds = TensorDataset(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())
    pruning = GradualPruning(final_sparsity=0.9, start_step=s["warmup"], n_steps=4, frequency=s["dt"],
                             sparse_kernels="auto", kernel_tokens=256, storage_density=0.5)
    count = Count()
    model = GPT(cfg, seed=0, warmup_steps=2, max_steps=s["steps"])
    model.load_state_dict(trained_state(cfg))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=s["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[pruning, count], default_root_dir=tempfile.mkdtemp())
    trainer.fit(model, DataLoader(ds, batch_size=16, shuffle=False, drop_last=True))
    # summed over replica 0's pipeline ranks: bytes into the data-parallel all-reduce per step
    mine = torch.tensor([count.bytes, count.grads, count.pruned], dtype=torch.float64)
    if strategy.pipeline.layout.dp_rank != 0:
        mine.zero_()
    dist.all_reduce = real_all_reduce
    dist.all_reduce(mine)
    sent_steps, grads, pruned = (row.tolist() for row in mine)
    if trainer.global_rank == 0:
        json.dump({
            "dp_layout": "pp=2 x dp=2",
            "dp_grad_bytes_per_step": {"dense": int(sent_steps[0]), "pruned_90": int(sent_steps[-1])},
            "dp_grad_bytes_ratio": round(sent_steps[-1] / sent_steps[0], 4),
            "dp_grad_bytes_ratio_pruned_layers": round(pruned[-1] / pruned[0], 4),
            "dp_pruned_layers_share_dense": round(pruned[0] / grads[0], 4),
            "dp_grad_bytes_equal_gradient_bytes": sent_steps == grads,
            "dp_sparsity": round(pruning.sparsity, 4),
        }, open(out, "w"))


if __name__ == "__main__":
    _dp_worker(sys.argv[1])
