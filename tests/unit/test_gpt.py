import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dynmo.data import ByteTextDataModule
from lightning_dynmo.strategy.setup_checks import skipped_training_step_warning
from lightning_dynmo.models import GPT, Block, Embedding, FinalNorm, GPTConfig, Head, WarmupCosine


def tiny(**kw):
    return GPT(GPTConfig.preset("tiny"), seed=0, **kw)


def batch(b=2, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def test_shapes_and_layer_protocol():
    m = tiny()
    layers = m.pipeline_layers()
    assert layers is m.pipeline_layers() and layers is m.layers
    assert isinstance(layers, nn.ModuleList) and len(layers) == m.config.n_layer + 3
    assert isinstance(layers[0], Embedding) and isinstance(layers[-2], FinalNorm)
    assert isinstance(layers[-1], Head) and all(isinstance(l, Block) for l in layers[1:-2])
    # no alias references outside the ModuleList
    names = {n.split(".")[0] for n, _ in m.named_parameters()}
    assert names == {"layers"}
    x, _ = batch()
    h = layers[0](x)
    assert h.shape == (2, 16, 32) and h.dtype == torch.float32
    for layer in layers[1:-1]:
        h = layer(h)
        assert h.shape == (2, 16, 32)
    out = layers[-1](h)
    assert out.shape == (2, 16, 256)
    m.eval()
    assert torch.allclose(out, m(x), atol=1e-6)
    blk = layers[1]
    for lin in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc, blk.mlp.proj):
        assert type(lin) is nn.Linear


def test_loss_at_init_is_uniform():
    m = tiny()
    x, y = batch(4, 32)
    loss = m.pipeline_loss(m(x), y)
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.1


def test_causal():
    m = tiny().eval()
    x, _ = batch(1, 20)
    x2 = x.clone()
    x2[0, 12] = (x2[0, 12] + 1) % 256
    a, b = m(x), m(x2)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_seed_reproducible_and_init_style():
    a, b, c = tiny(), tiny(), GPT(GPTConfig.preset("tiny"), seed=1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.layers[1].attn.qkv.weight, c.layers[1].attn.qkv.weight)
    assert torch.count_nonzero(a.layers[1].attn.qkv.bias) == 0
    std = a.layers[1].mlp.proj.weight.std().item()
    assert std < 0.02 / math.sqrt(2 * 4) * 1.3
    # seeding the init does not reset the caller's RNG stream
    torch.manual_seed(5)
    r1 = torch.rand(1)
    torch.manual_seed(5)
    tiny()
    assert torch.equal(torch.rand(1), r1)


def test_hparams_config_is_dict_and_roundtrips():
    cfg = GPTConfig.preset("tiny", mlp_ratios=(1, 2, 3, 4))
    m = GPT(cfg)
    assert isinstance(m.hparams.config, dict)
    m2 = GPT(**m.hparams)
    assert m2.config == m.config
    assert [blk.mlp.fc.out_features for blk in m2.layers[1:-2]] == [32, 64, 96, 128]
    assert GPT("tiny").config == GPTConfig.preset("tiny")
    with pytest.raises(ValueError, match="mlp_ratios"):
        GPTConfig(n_layer=2, mlp_ratios=(1,))


def _group_sizes(opt):
    return [sum(p.numel() for p in g["params"]) for g in opt.param_groups]


def test_optimizer_groups_subset_and_frozen():
    m = tiny(max_steps=100)
    opt = m.configure_optimizers()["optimizer"]
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 2
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert sum(_group_sizes(opt)) == sum(p.numel() for p in m.parameters())
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8

    # the strategy swaps layers it does not own for placeholders
    layers = m.pipeline_layers()
    for i in (0, 1, 2, len(layers) - 1):
        layers[i] = nn.Identity()
    opt = m.configure_optimizers()["optimizer"]
    assert sum(_group_sizes(opt)) == sum(p.numel() for p in m.parameters())

    # frozen params are left out
    for p in layers[3].parameters():
        p.requires_grad_(False)
    opt = m.configure_optimizers()["optimizer"]
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert sum(_group_sizes(opt)) == trainable
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in ids for p in layers[3].parameters())


def test_lr_schedule_warmup_cosine():
    m = tiny(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    cfg = m.configure_optimizers()
    assert cfg["lr_scheduler"]["interval"] == "step"
    sched, opt = cfg["lr_scheduler"]["scheduler"], cfg["optimizer"]
    lrs = []
    for _ in range(130):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-4)  # (0+1)/10 * lr
    assert lrs[9] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # cosine midpoint
    assert lrs[110] == pytest.approx(1e-4) and lrs[129] == pytest.approx(1e-4)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[9:111], lrs[10:111]))  # monotone decay
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-4)
    # schedule state survives a state_dict round trip
    fresh = tiny(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=999).configure_optimizers()
    fresh["lr_scheduler"]["scheduler"].load_state_dict(sched.state_dict())
    assert fresh["lr_scheduler"]["scheduler"].lr_lambdas[0].max_steps == 110
    # unknown length: constant after warmup
    assert WarmupCosine(2, -1, 1.0, 0.1)(50) == 1.0


def test_generate():
    m = tiny()
    out = m.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=40, top_k=5)
    assert out.shape == (2, 43) and m.training
    g1 = m.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0)
    g2 = m.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0)
    assert torch.equal(g1, g2)


def test_trainer_reduces_loss(tmp_path):
    L.seed_everything(0)
    dm = ByteTextDataModule(block_size=32, batch_size=16)
    m = GPT("tiny", lr=3e-3, warmup_steps=2, seed=0)
    dm.setup()
    x, y = next(iter(dm.val_dataloader()))
    before = m.pipeline_loss(m(x), y).item()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
        val_check_interval=5,
    )
    trainer.fit(m, datamodule=dm)
    m.eval()
    with torch.no_grad():
        after = m.pipeline_loss(m(x), y).item()
    assert after < before - 0.2
    assert "train_loss" in trainer.callback_metrics
    assert trainer.callback_metrics["train_ppl"] == pytest.approx(math.exp(trainer.callback_metrics["train_loss"]),
                                                                  rel=1e-5)
    # its per-step logic lives in the pipeline hook, so DynMoStrategy has nothing to warn about
    assert skipped_training_step_warning(m) is None
    assert "val_loss" in trainer.callback_metrics
    ppl = trainer.callback_metrics["val_ppl"]
    assert ppl == pytest.approx(math.exp(trainer.callback_metrics["val_loss"]), rel=1e-4)
    # checkpoints are portable: config is stored as a plain dict
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    loaded = GPT.load_from_checkpoint(tmp_path / "m.ckpt")
    assert loaded.config == m.config
    for a, b in zip(loaded.parameters(), m.parameters()):
        assert torch.equal(a, b)


def test_presets_and_errors():
    assert GPTConfig.preset("tiny") == GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=32)
    small = GPTConfig.preset("small-cpu")
    assert small.vocab_size == 256 and small.block_size == 128
    g2 = GPTConfig.preset("gpt2")
    assert (g2.n_layer, g2.n_head, g2.n_embd, g2.block_size) == (12, 12, 768, 1024)
    assert GPTConfig.preset("gpt2-medium").n_layer == 24
    assert GPTConfig.preset("gpt2", vocab_size=256).vocab_size == 256
    with pytest.raises(ValueError, match="tiny"):
        GPTConfig.preset("nope")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="unknown GPTConfig keys"):
        GPT({"n_layers": 3})
    with pytest.raises(ValueError, match="block_size"):
        tiny()(torch.zeros(1, 33, dtype=torch.long))


def test_tied_embeddings_share_one_parameter_whose_gradient_sums_both_uses():
    """GPT-2's tying: the head uses the token embedding's matrix; its gradient is the sum of the
    embedding's and the head's gradients of the same model untied with equal values."""
    import torch

    from lightning_dynmo.models import GPT, GPTConfig

    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    tied = GPT(GPTConfig(**cfg, tie_embeddings=True), seed=0)
    untied = GPT(GPTConfig(**cfg), seed=0)
    emb, head = tied.layers[0].wte.weight, tied.layers[-1].lm_head.weight
    assert head is emb and torch.equal(emb, untied.layers[0].wte.weight)  # the embedding's values win
    n = sum(p.numel() for p in untied.parameters())
    assert sum(p.numel() for p in tied.parameters()) == n - emb.numel()
    assert {"layers.0.wte.weight", f"layers.{len(tied.layers) - 1}.lm_head.weight"} <= tied.state_dict().keys()
    with torch.no_grad():
        untied.layers[-1].lm_head.weight.copy_(untied.layers[0].wte.weight)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (tied, untied):
        m.pipeline_loss(m(x), x).backward()
    want = untied.layers[0].wte.weight.grad + untied.layers[-1].lm_head.weight.grad
    torch.testing.assert_close(emb.grad, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="tie_embeddings"):
        GPTConfig(**cfg, tie_embeddings="yes")
