"""The dynamism callbacks under plain single-process Lightning (``accelerator="cpu", devices=1``)."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.callbacks import EarlyExit, GradualPruning, LayerFreezing
from lightning_dynmo.dynamic import EarlyExitGPT, PrunableLinear
from lightning_dynmo.models import GPT

CFG = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, bias=True)


def loader(n=64, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 64, (n, 17), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch, shuffle=False)


def trainer(tmp_path, steps, callbacks, **kw):
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0, **kw)


class RecordingStrategy(SingleDeviceStrategy):
    """A single-device strategy that, like DynMoStrategy, accepts rebalance requests."""

    def __init__(self):
        super().__init__(device=torch.device("cpu"))
        self.requests: list[str] = []
        self.invalidations = 0

    def request_rebalance(self, reason: str = "requested") -> None:
        self.requests.append(reason)

    def invalidate_pipeline(self) -> None:
        self.invalidations += 1


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------- freezing
def test_scheduled_freezing_no_grad_no_update(tmp_path):
    model = GPT(CFG, seed=0, warmup_steps=0)
    cb = LayerFreezing(schedule={2: 2, 4: 3})
    strategy = RecordingStrategy()
    seen = {}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 5:
                seen["grads"] = {n: p.grad for n, p in pl_module.named_parameters()}
                seen["state"] = {n: (p in optimizer.state) for n, p in pl_module.named_parameters()}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:
                seen["before"] = snapshot(pl_module)

    tr = trainer(tmp_path, 7, [cb, Probe()], strategy=strategy)
    tr.fit(model, loader())
    after = snapshot(model)
    layers = model.pipeline_layers()
    assert cb.n_frozen == 3 and [h["n_frozen"] for h in cb.history] == [2, 3]
    for i, layer in enumerate(layers):
        prefix = f"layers.{i}."
        for n, p in layer.named_parameters():
            name = prefix + n
            if i < 3:
                assert not p.requires_grad and p.grad is None
                assert seen["grads"][name] is None and not seen["state"][name]
                assert torch.equal(after[name], seen["before"][name])  # no optimizer update (no decay)
            else:
                assert p.requires_grad and seen["grads"][name] is not None and seen["state"][name]
        if i >= 3 and i < len(layers) - 1:
            assert any(not torch.equal(after[prefix + n], seen["before"][prefix + n])
                       for n, _ in layer.named_parameters())
    assert len(strategy.requests) == 2 and strategy.requests[0].startswith("freezing:")
    assert strategy.invalidations == 2


def test_convergence_freezing_front_to_back(tmp_path):
    model = GPT(CFG, seed=0)
    cb = LayerFreezing(threshold=1e9, interval=2, max_frozen=3)  # everything "converged": freeze up to the cap
    tr = trainer(tmp_path, 6, [cb])  # plain strategy: no rebalance method, must still work
    tr.fit(model, loader())
    assert cb.n_frozen == 3 and cb.history[0]["step"] == 4  # two windows of 2 steps, then decide
    assert [any(p.requires_grad for p in l.parameters()) for l in model.pipeline_layers()] == [False] * 3 + [True] * 4

    cb2 = LayerFreezing(threshold=1e-12, interval=2)  # nothing converges
    tr2 = trainer(tmp_path, 6, [cb2])
    tr2.fit(GPT(CFG, seed=0), loader())
    assert cb2.n_frozen == 0


class RecordingFreezing(LayerFreezing):
    """Records the interval means the convergence criterion compares."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        before = self._prev
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._prev is not before:
            self.means = getattr(self, "means", []) + [list(self._prev)]


def _first_freeze(threshold: float, means: list[list[float]], limit: int) -> tuple[int, int]:
    """(decision index, layers frozen) of the criterion's first freeze on recorded window means:
    front to back, a layer freezes while its relative change stays below the threshold."""
    for d, (prev, mean) in enumerate(zip(means, means[1:])):
        n = 0
        while n < limit and abs(mean[n] - prev[n]) / prev[n] < threshold:
            n += 1
        if n:
            return d, n
    return len(means) - 1, 0


def test_convergence_threshold_discriminates_between_layers(tmp_path):
    """With a threshold between the layers' measured relative gradient-norm changes, exactly the
    front run of layers below it freezes (some, not all; a converged layer behind an unconverged
    one waits)."""
    probe = RecordingFreezing(threshold=1e-12, interval=2)  # nothing freezes: record the windows
    trainer(tmp_path, 8, [probe]).fit(GPT(CFG, seed=0), loader())
    limit = len(probe.means[0]) - 2  # the final norm and the head always stay trainable
    rels = sorted({abs(b - a) / a for m, n in zip(probe.means, probe.means[1:]) for a, b in zip(m[:limit], n[:limit])})
    candidates = [((lo + hi) / 2, hi - lo) for lo, hi in zip(rels, rels[1:])]
    outcomes = [(margin, t, *_first_freeze(t, probe.means, limit)) for t, margin in candidates]
    margin, threshold, decision, k = max(o for o in outcomes if 0 < o[3] < limit)
    step = 2 * (decision + 2)  # decisions close windows of 2 steps; the first compares two windows
    cb = LayerFreezing(threshold=threshold, interval=2)
    model = GPT(CFG, seed=0)
    trainer(tmp_path, step + 1, [cb]).fit(model, loader())  # same seed and data: the same windows
    assert cb.n_frozen == k and [h["step"] for h in cb.history] == [step], (threshold, k, cb.history)
    trainable = [any(q.requires_grad for q in layer.parameters()) for layer in model.pipeline_layers()]
    assert trainable == [False] * k + [True] * (len(trainable) - k)


# ---------------------------------------------------------------------------------- pruning
class CheckedPruning(GradualPruning):
    """Checks each pruning decision against a brute-force global torch.kthvalue threshold."""

    checks: list

    def prune(self, trainer, pl_module, sparsity):
        mods = [m for _, _, m in self._local_prunable(pl_module)]
        allw = torch.cat([m.dense_weight().abs().flatten() for m in mods])
        k = int(round(sparsity * allw.numel()))
        brute = float(allw.kthvalue(k).values) if k else -math.inf
        expected = [m.dense_mask() & (m.dense_weight().abs() > brute) for m in mods]
        out = super().prune(trainer, pl_module, sparsity)
        assert self.history[-1]["threshold"] == brute
        assert all(torch.equal(m.dense_mask(), e) for m, e in zip(mods, expected))
        self.checks.append((trainer.global_step, sparsity, out, k / allw.numel()))
        return out


@pytest.mark.parametrize("sparse_kernels", [False, True])
def test_gradual_pruning_schedule_masks_and_threshold(tmp_path, sparse_kernels):
    model = GPT(CFG, seed=0, warmup_steps=0)
    cb = CheckedPruning(final_sparsity=0.75, start_step=1, n_steps=3, frequency=2, sparse_kernels=sparse_kernels)
    cb.checks = []
    strategy = RecordingStrategy()
    tr = trainer(tmp_path, 9, [cb], strategy=strategy)
    tr.fit(model, loader())
    assert [c[0] for c in cb.checks] == [1, 3, 5, 7]
    for step, target, measured, exact in cb.checks:
        assert target == pytest.approx(cb.sparsity_at(step))
        assert measured == pytest.approx(exact, abs=1e-3)  # k of N pruned (ties at random init: none)
    assert cb.checks[-1][1] == pytest.approx(0.75) and cb.sparsity == pytest.approx(0.75, abs=1e-3)
    mods = [m for m in model.modules() if isinstance(m, PrunableLinear)]
    assert len(mods) == 4 * CFG["n_layer"]  # blocks only: not the embedding or head
    assert type(model.layers[-1].lm_head) is torch.nn.Linear
    opt = tr.optimizers[0]
    for m in mods:  # masks stay applied after optimizer steps (AdamW momentum, weight decay)
        assert m.compressed == (m.density <= 0.5)  # default storage_density: CSR-stored below 50 %
        assert torch.all(m.dense_weight()[~m.dense_mask()] == 0)
        for v in opt.state[m.weight].values():
            if torch.is_tensor(v) and v.shape == m.weight.shape:  # CSR-stored: nnz-long, nothing pruned
                assert v.numel() == m.nnz if m.compressed else torch.all(v[~m.weight_mask] == 0)
    densities = [m.density for m in mods]
    assert min(densities) < max(densities)  # global, not per-layer: layers keep different amounts
    # t0 (s_i = 0) prunes nothing and requests nothing; steps 3, 5, 7 request a rebalance
    assert len(strategy.requests) == 3 and all(r.startswith("pruning:") for r in strategy.requests)
    if sparse_kernels and cb._choose_kernel(tr, mods[0]) == "csr":
        assert all(m.sparse_kernel for m in mods)
        assert set(cb.kernels.values()) == {"csr"}


# ---------------------------------------------------------------------------------- early exit
def test_early_exit_callback_schedule_logging_and_requests(tmp_path):
    model = EarlyExitGPT(CFG, seed=0)
    cb = EarlyExit(threshold=None, schedule={3: 0.0}, drift=0.1, check_interval=1)
    strategy = RecordingStrategy()
    logger = CSVLogger(tmp_path)
    tr = trainer(tmp_path, 6, [cb], strategy=strategy, logger=logger, log_every_n_steps=1)
    tr.fit(model, loader())
    assert all(b.exit_threshold == 0.0 for _, b in model.exit_blocks())
    assert len(strategy.requests) >= 1 and strategy.requests[0].startswith("early exit:")
    assert cb.requests[0]["step"] >= 4  # nobody exits before the schedule lowers the threshold
    fr = cb.last_fractions
    assert fr[1] == 1.0 and fr[-1] != fr[-1]  # first block sees everything; head: not a block (NaN)
    assert fr[2] < 1.0
    metrics = tr.callback_metrics
    assert "early_exit/active_fraction_L2" in metrics and "early_exit/active_fraction" in metrics


def test_early_exit_threshold_discriminates_between_tokens(tmp_path):
    """A saturation threshold at the median of the first block's measured saturations lets
    exactly the tokens above it leave: the fraction entering the next block is strictly between 0
    and 1 and equals the count the threshold implies."""
    model = EarlyExitGPT(CFG, seed=0)
    x, _ = next(iter(loader()))
    with torch.no_grad():
        h, flag = model.layers[0](x)
        out, _ = model.layers[1](h, flag)  # block 0, nobody exits yet (threshold None)
        sat = torch.nn.functional.cosine_similarity(out.float(), h.float(), dim=-1).flatten()
    threshold = float(sat.median())
    expected = float((sat <= threshold).sum()) / sat.numel()
    assert 0 < expected < 1
    cb = EarlyExit(threshold=threshold, check_interval=1)
    trainer(tmp_path, 1, [cb]).fit(model, loader())  # step 0 runs batch 0 on these weights
    fr = cb.last_fractions
    assert fr[1] == 1.0 and fr[2] == pytest.approx(expected, abs=1e-12), (fr, expected)


# ---------------------------------------------------------------------------------- composition + resume
def test_all_callbacks_compose_and_resume_from_checkpoint(tmp_path):
    def callbacks():
        return [
            LayerFreezing(schedule={2: 1}),
            GradualPruning(final_sparsity=0.6, start_step=1, n_steps=3, frequency=2, sparse_kernels=False),
            EarlyExit(schedule={3: 0.3}, check_interval=2),
            ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4),
            EarlyStopping(monitor="train_loss", patience=100, check_on_train_epoch_end=True),
            LearningRateMonitor(logging_interval="step"),
        ]

    model = EarlyExitGPT(CFG, seed=0)
    cbs = callbacks()
    tr = trainer(tmp_path, 4, cbs, logger=CSVLogger(tmp_path), enable_checkpointing=True, log_every_n_steps=1)
    tr.fit(model, loader())
    ckpt = tmp_path / "manual.ckpt"
    tr.save_checkpoint(ckpt)
    freeze, prune, exit_cb = cbs[:3]
    assert freeze.n_frozen == 1 and prune.last_prune_step == 3 and len(prune.history) == 2

    raw = torch.load(ckpt, weights_only=False)
    assert any("weight_mask" in k for k in raw["state_dict"])
    assert {"LayerFreezing", "GradualPruning", "EarlyExit"} <= set(raw["callbacks"])

    model2 = EarlyExitGPT(CFG, seed=1)  # different init: everything must come from the checkpoint
    cbs2 = callbacks()

    class AtResume(L.Callback):
        """Runs after every callback's own on_train_start (it is registered last): the state the
        resumed run starts from."""

        checked = False

        def on_train_start(self, trainer, pl_module):
            f, p, e = cbs2[:3]
            assert f.n_frozen == 1 and f.history == freeze.history
            assert p.last_prune_step == 3 and p.history == prune.history and p.sparsity == prune.sparsity
            assert e.baseline == exit_cb.baseline and e.requests == exit_cb.requests
            assert not any(q.requires_grad for q in pl_module.layers[0].parameters())
            buffers = dict(model.named_buffers())
            assert dict(pl_module.named_buffers()).keys() == buffers.keys()
            for n, a in pl_module.named_buffers():
                assert torch.equal(a, buffers[n]), n
            for n, q in pl_module.named_parameters():  # everything came from the checkpoint, not seed=1
                assert torch.equal(q, dict(model.named_parameters())[n]), n
            AtResume.checked = True

    cbs2.append(AtResume())
    tr2 = trainer(tmp_path, 8, cbs2, logger=CSVLogger(tmp_path), enable_checkpointing=True, log_every_n_steps=1)
    tr2.fit(model2, loader(), ckpt_path=ckpt)
    assert AtResume.checked
    f2, p2, e2 = cbs2[:3]
    assert tr2.global_step == 8 and f2.n_frozen == 1
    assert [h["step"] for h in p2.history] == [1, 3, 5, 7] and p2.sparsity == pytest.approx(0.6, abs=1e-3)
    for m in model2.modules():
        if isinstance(m, PrunableLinear):
            assert torch.all(m.dense_weight()[~m.dense_mask()] == 0)
