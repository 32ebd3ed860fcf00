"""Model and data shared by the multi-process workers and the single-process references."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import itertools
import json
import os
import sys
import time

import lightning as L

from lightning_dynmo import Partition, register_balancer
from lightning_dynmo.plan.balancers import BalanceResult
from lightning_dynmo.models import GPT, EarlyExitGPT, GPTConfig


class SGDGPT(GPT):
    """The test GPT trained by SGD with momentum (the module's LR schedule kept): an update is
    the gradient times the LR, so a constant factor in the gradient (a missing data-parallel
    divisor or micro-batch mean) changes the weights, where Adam's normalisation cancels it."""

    def configure_optimizers(self):
        conf = super().configure_optimizers()
        adam = conf["optimizer"]
        sgd = torch.optim.SGD([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in adam.param_groups],
                              lr=self.hparams.lr, momentum=0.9)
        sched = conf["lr_scheduler"]["scheduler"]
        conf["optimizer"] = sgd
        conf["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(sgd, sched.lr_lambdas[0])
        return conf


def make_model(cfg: dict, cls: type = GPT) -> GPT:
    """The test GPT; ``cfg["gpt"]``: further GPTConfig fields; ``cfg["tied"]``: the LM head shares
    the token embedding's weight (GPT-2's tying), so the parameter is used by the first and the
    last pipeline layer; ``cfg["early_exit_gpt"]``: an EarlyExitGPT with these kwargs (same weights);
    ``cfg["unused"]``: see :func:`add_unused_parameters`."""
    n_layer = cfg.get("n_layer", 6)
    config = GPTConfig(
        vocab_size=64,
        block_size=cfg.get("block", 16),
        n_layer=n_layer,
        n_head=2,
        n_embd=cfg.get("n_embd", 32),
        dropout=cfg.get("dropout", 0.0),
        bias=False,  # the key bias has an exactly-zero gradient; Adam would amplify rounding noise there
        mlp_ratios=tuple(cfg.get("mlp_ratios", [1, 4, 2, 8, 1, 3][:n_layer])),  # heterogeneous layers
        tie_embeddings=bool(cfg.get("tied", False)),
        **cfg.get("gpt", {}),  # further GPTConfig fields (e.g. attention="hash_sparse")
    )
    cls = SGDGPT if cfg.get("optimizer") == "sgd" and cls is GPT else cls
    kw = {}
    if cfg.get("early_exit_gpt") and cls is GPT:  # EarlyExitGPT kwargs (exit_layers, exit_threshold)
        cls, kw = EarlyExitGPT, dict(cfg["early_exit_gpt"])
    model = cls(config, lr=cfg.get("lr", 3e-3), warmup_steps=2, max_steps=20, seed=cfg.get("seed", 0), **kw)
    add_unused_parameters(model, cfg.get("unused", ()))
    return model


def pin_to_own_core() -> None:
    """This rank, for the rest of its job, on a core of its own (global rank r on the r-th core the
    job may run on) where there are at least as many cores as ranks: its peers' compute then never
    shares its core, as on a machine with a device per rank (the host's other jobs still may)."""
    cores = sorted(os.sched_getaffinity(0))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if len(cores) >= world:
        os.sched_setaffinity(0, {cores[rank]})


def add_unused_parameters(model, unused) -> None:
    """``unused``: ``[[layer, shape], ...]``: a parameter ``unused`` of that shape on each pipeline
    layer, which no forward reads (it never gets a gradient anywhere). A 2-D one falls in the
    weight-decayed optimizer group, a 1-D one in the other; one process leaves both untouched."""
    layers = model.pipeline_layers()
    for k, (layer, shape) in enumerate(unused):
        g = torch.Generator().manual_seed(1000 + k)
        layers[int(layer)].register_parameter("unused", torch.nn.Parameter(torch.randn(*shape, generator=g)))


class EpochPermutation(torch.utils.data.Sampler):
    """The permutation DistributedSampler(shuffle=True, seed=0) deals out to the replicas
    (replica r takes every dp-th index from r): a new one per epoch (Lightning calls ``set_epoch``)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


def make_loader(cfg: dict, batch: int, reference: bool = False, dp: int | None = None) -> DataLoader:
    """The pipeline gets a plain ``shuffle=False`` loader. With one data-parallel replica the
    strategy injects no sampler, so the pipeline sees the loader's own order, like single-process
    Lightning. With ``dp > 1`` replicas Lightning injects DistributedSampler(shuffle=True, seed=0)
    (it always shuffles training data then). ``reference=True`` gives a single process what the
    pipeline sees over all replicas: for ``dp > 1`` the same permutation, so step k sees the union
    of the replicas' batches k and ``batch[r::dp]`` is exactly replica r's batch; for ``dp == 1``
    the plain order. ``dp`` defaults to ``batch // cfg["batch"]`` (references load the whole
    global batch)."""
    g = torch.Generator().manual_seed(123)
    n = cfg.get("n_samples", 512)
    data = torch.randint(0, 64, (n, cfg.get("block", 16) + 1), generator=g)
    targets = data[:, 1:].clone()
    if cfg.get("padded"):  # SFT-style: each sample keeps 1..block targets, the rest are -100 (ignored)
        block = targets.shape[1]
        keep = torch.randint(1, block + 1, (n,), generator=torch.Generator().manual_seed(7))
        targets[torch.arange(block)[None, :] >= keep[:, None]] = -100
    ds = TensorDataset(data[:, :-1].contiguous(), targets)
    if dp is None:
        dp = max(1, batch // cfg["batch"]) if reference and cfg.get("batch") else 1
    if reference and dp > 1:
        return DataLoader(ds, batch_size=batch, sampler=EpochPermutation(n), drop_last=True)
    return DataLoader(ds, batch_size=batch, shuffle=False, drop_last=cfg.get("drop_last", True))


def reference_batches(cfg: dict, dp: int):
    """The global batches a single process sees, epoch after epoch, as :func:`make_loader`'s
    reference loader gives them to Lightning (which calls ``set_epoch`` at each epoch)."""
    loader = make_loader(cfg, cfg["batch"] * dp, reference=True, dp=dp)
    for epoch in itertools.count():
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader


def shift_one_boundary(problem):
    """Moves boundaries at every call (a legitimate user balancer): shift the first boundary that
    can move one layer, alternating direction, so every rebalance migrates layers."""
    cur = problem.current or Partition.from_sizes([1] * (problem.num_stages - 1)
                                                  + [problem.num_layers - problem.num_stages + 1])
    b = list(cur.boundaries)
    S = len(b) - 1
    # rotate: move one layer from the largest stage to its right (or left) neighbour
    sizes = list(cur.sizes)
    big = max(range(S), key=lambda s: (sizes[s], -s))
    if big + 1 < S:
        b[big + 1] -= 1
    else:
        b[big] += 1
    new = Partition(tuple(b))
    t = problem.model.predicted_step_time(problem.costs, new)
    return BalanceResult(partition=new, rounds=1, predicted_step_time=t, max_load=t, name="shift_one_boundary",
                         loads=())


# the same user balancer under the names the workers use
for _name in ("test_cycle", "test_shift"):
    register_balancer(_name, override=True)(shift_one_boundary)


class FreezeThenUnfreeze(L.Callback):
    """What a user (or Lightning's BaseFinetuning) does by hand: ``requires_grad_(False)`` on the
    first ``n`` pipeline layers at step ``freeze_at``, ``requires_grad_(True)`` at ``unfreeze_at``,
    without telling the strategy (layers another rank holds have no parameters here)."""

    def __init__(self, n: int, freeze_at: int, unfreeze_at: int):
        self.n, self.freeze_at, self.unfreeze_at = n, freeze_at, unfreeze_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in (self.freeze_at, self.unfreeze_at):
            for layer in list(pl_module.pipeline_layers())[: self.n]:
                for p in layer.parameters():
                    p.requires_grad_(trainer.global_step == self.unfreeze_at)


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []
        self.step_seconds = []
        self.imbalance = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        self.step_seconds.append(time.perf_counter() - self._t0)
        imb = trainer.callback_metrics.get("pipeline/imbalance")
        self.imbalance.append(float(imb) if imb is not None else None)


def run_spec(run_one) -> None:
    """Worker entry point: run every config of the spec file in argv[1] through
    ``run_one(cfg, out_dir, index)``, write rank 0's results, and tear the process group down
    (gloo threads left to interpreter shutdown can abort a finished process)."""
    import torch.distributed as dist

    spec = json.load(open(sys.argv[1]))
    out_dir = os.path.dirname(os.path.abspath(spec["out"]))
    results = [run_one(cfg, out_dir, i) for i, cfg in enumerate(spec["runs"])]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(spec["out"], "w") as fh:
            json.dump({"runs": results}, fh, default=str)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def record_errors(run_case, names: list[str], out: str) -> None:
    """Worker entry point for cases expected to fail: ``run_case(name)`` for each name, each one's
    error (``"Type: message"``; None: it passed) in ``<out>.rank<RANK>.json``, then the process group
    torn down as :func:`run_spec` does."""
    import torch.distributed as dist

    errors = {}
    for name in names:
        try:
            run_case(name)
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            errors[name] = f"{type(exc).__name__}: {exc}"
    with open(f"{out}.rank{int(os.environ['RANK'])}.json", "w") as fh:
        json.dump(errors, fh)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class NoProtocol(L.LightningModule):
    """A LightningModule without the pipeline protocol (no ``pipeline_layers``): one linear layer
    over the token ids as floats (``width_in``: the loader's sequence length)."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.net = torch.nn.Linear(width_in, width_out)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def two_stream_loader(batch: int) -> DataLoader:
    """Data of the two-stream toy model (tests/support/two_stream.py)."""
    data = torch.randint(0, 32, (64, 13), generator=torch.Generator().manual_seed(7))
    return DataLoader(TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous()), batch_size=batch,
                      shuffle=False, drop_last=True)
