"""``GPTConfig(pipeline_granularity="sublayer")``: each block's attention and MLP halves are
pipeline layers of their own, and nothing else changes: the same function and gradients, the same
parameters in the same optimizer order, the block model's state-dict keys (checkpoints cross
granularities both ways), per-layer load counters on the half that does the work, and freezing
that never leaves a block half frozen."""
from __future__ import annotations

import io

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dynmo.callbacks import LayerFreezing
from lightning_dynmo.callbacks.freezing import whole_units
from lightning_dynmo.dynamic.pruning import default_prunable_layer
from lightning_dynmo.models import (AttentionHalf, Block, EarlyExitGPT, FinalNorm, GPT, GPTConfig, Head, MLPHalf,
                                    MoDGPT, MoEGPT, MoEHalf, SparseAttentionHalf)
from lightning_dynmo.protocol import state_dict_key
from lightning_dynmo.runtime.materialize import materialize_pipeline
from tests.support.workers.common import LossRecorder

BASE = dict(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, mlp_ratios=(1, 4, 2))


def config(granularity: str, **kw) -> GPTConfig:
    return GPTConfig(**{**BASE, **kw}, pipeline_granularity=granularity)


def pair(cls=GPT, seed: int = 7, **kw):
    return cls(config("block", **kw), seed=seed), cls(config("sublayer", **kw), seed=seed)


def data(seed: int = 0, b: int = 4, t: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, t), generator=g), torch.randint(0, 64, (b, t), generator=g)


def grads_by_key(model: nn.Module) -> dict[str, torch.Tensor]:
    return {state_dict_key(model, n): p.grad for n, p in model.named_parameters()}


def assert_same_model(block: nn.Module, sub: nn.Module) -> None:
    """Same keys in the same order, bitwise-equal values."""
    a, b = block.state_dict(), sub.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_step(block: nn.Module, sub: nn.Module, seed: int = 0, t: int = 16) -> None:
    """Bitwise-equal logits, loss and gradients on one batch (training mode)."""
    x, y = data(seed, t=t)
    block.train(), sub.train()
    out_a, out_b = block(x), sub(x)
    assert torch.equal(out_a, out_b)
    la, lb = block.pipeline_loss(out_a, y), sub.pipeline_loss(out_b, y)
    la.backward(), lb.backward()
    assert torch.equal(la, lb)
    ga, gb = grads_by_key(block), grads_by_key(sub)
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


def test_sublayer_layout_and_protocol():
    block, sub = pair()
    layers = sub.pipeline_layers()
    assert len(layers) == 2 * BASE["n_layer"] + 3 and len(block.pipeline_layers()) == BASE["n_layer"] + 3
    assert [type(l) for l in layers[1:-2]] == [AttentionHalf, MLPHalf] * BASE["n_layer"]
    assert isinstance(layers[-2], FinalNorm) and isinstance(layers[-1], Head)
    assert sub.pipeline_layer_units() == (0, 1, 1, 2, 2, 3, 3, 4, 5)
    assert block.pipeline_layer_units() == tuple(range(6))
    # the halves hold the block's submodules: one parameter object each, in the block's order
    assert [p.shape for p in sub.parameters()] == [p.shape for p in block.parameters()]
    assert {n.split(".")[0] for n, _ in sub.named_parameters()} == {"layers"}
    assert state_dict_key(sub, "layers.4.mlp.fc.weight") == "layers.2.mlp.fc.weight"
    assert state_dict_key(block, "layers.2.mlp.fc.weight") == "layers.2.mlp.fc.weight"


@pytest.mark.parametrize("tied", [False, True])
def test_same_seed_same_weights_function_and_gradients(tied):
    block, sub = pair(tie_embeddings=tied)
    assert (sub.layers[-1].lm_head.weight is sub.layers[0].wte.weight) == tied
    assert_same_model(block, sub)
    assert_same_step(block, sub)
    assert sub.hparams.config["pipeline_granularity"] == "sublayer"


def test_state_dicts_cross_granularities_both_ways():
    block, sub = pair(seed=1)
    other_sub, other_block = GPT(config("sublayer"), seed=2), GPT(config("block"), seed=3)
    buf = io.BytesIO()
    torch.save(block.state_dict(), buf)
    other_sub.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))  # strict
    other_block.load_state_dict(sub.state_dict())  # strict
    assert_same_model(block, other_sub)
    assert_same_model(sub, other_block)
    assert_same_step(block, other_sub, seed=1)


def test_a_bad_key_still_fails_a_strict_load():
    _, sub = pair()
    state = sub.state_dict()
    state["layers.1.ln_3.weight"] = state.pop("layers.1.ln_2.weight")
    with pytest.raises(RuntimeError, match="ln_2.weight"):
        sub.load_state_dict(state)


def test_optimizer_state_is_the_block_models():
    """Same parameter order, so AdamW's single-process state_dict after a step is identical."""
    block, sub = pair(seed=4)
    opts = [m.configure_optimizers()["optimizer"] for m in (block, sub)]
    for model, opt in zip((block, sub), opts):
        x, y = data(1)
        model.pipeline_loss(model(x), y).backward()
        opt.step()
    a, b = (o.state_dict() for o in opts)
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["state"][i][k]), (i, k)
    assert_same_model(block, sub)


def test_meta_device_pieces_get_the_block_values():
    """A rank that materialises only some pieces (each from its unit's seed, after the draws of
    the pieces before it in the block) gets exactly the single-process values."""
    real = GPT(config("sublayer", tie_embeddings=False), seed=5)
    with torch.device("meta"):
        meta = GPT(config("sublayer"), seed=5)
    layers = meta.pipeline_layers()
    materialize_pipeline(meta, layers, range(len(layers)))
    assert_same_model(real, meta)


def test_hash_sparse_attention_halves_report_their_own_load():
    block, sub = pair(attention="hash_sparse", nb_hash=2, attention_block=16, block_size=64)
    assert_same_model(block, sub)
    assert_same_step(block, sub, t=64)
    halves = [(i, l) for i, l in enumerate(sub.layers) if isinstance(l, SparseAttentionHalf)]
    assert [i for i, _ in halves] == [1, 3, 5]
    assert not any(hasattr(l, "load_factor") for l in sub.layers if isinstance(l, MLPHalf))
    for (_, half), blk in zip(halves, block.layers[1:4]):
        d = half.attention_density()
        assert d == blk.attention_density() and 0 < d <= 1
        # the same density weighs more in the attention half alone than in the whole block
        assert half.load_factor() < 1 and half.load_factor() <= blk.load_factor()
        assert half.relative_work(d) == pytest.approx(half.load_factor())
        half.reset_load()
        assert half.load_factor() is None


def test_moe_halves_carry_routing_counters_and_same_gradients():
    moe = dict(num_experts=4, top_k=2, moe_every=2, aux_loss_coeff=0.01)
    block = MoEGPT(config("block"), moe=moe, seed=3)
    sub = MoEGPT(config("sublayer"), moe=moe, seed=3)
    assert_same_model(block, sub)
    assert_same_step(block, sub)  # aux loss included (it rides the MoE layer's backward)
    assert [i for i, _ in sub.moe_blocks()] == [4] and [i for i, _ in block.moe_blocks()] == [2]
    half = sub.layers[4]
    assert isinstance(half, MoEHalf) and isinstance(sub.layers[3], AttentionHalf)
    counts = half.expert_counts()
    assert int(counts.sum()) == 4 * 16 * 2 and torch.equal(counts, block.layers[2].expert_counts())
    # dropless routing: the MoE half's work is the full capacity's, like the block's
    assert half.load_factor() == pytest.approx(1.0) and block.layers[2].load_factor() == pytest.approx(1.0)


def test_moe_half_load_counts_the_moe_layer_alone():
    moe = dict(num_experts=4, top_k=1, moe_every=1, capacity_factor=0.5)
    block = MoEGPT(config("block"), moe=moe, seed=3)
    sub = MoEGPT(config("sublayer"), moe=moe, seed=3)
    x, _ = data(2)
    block.train()(x), sub.train()(x)
    for j, i in zip((2, 4, 6), (1, 2, 3)):
        half, blk = sub.layers[j], block.layers[i]
        # capacity drops tokens: the drop is a larger share of the MoE half's work than of the block's
        assert half.load_factor() < blk.load_factor() < 1.0


def test_models_that_route_around_whole_blocks_refuse_sublayers():
    with pytest.raises(ValueError, match="EarlyExitGPT does not support pipeline_granularity='sublayer'"):
        EarlyExitGPT(config("sublayer"))
    with pytest.raises(ValueError, match="MoDGPT does not support pipeline_granularity='sublayer'.*'block'"):
        MoDGPT(config("sublayer"), mod=dict(every=1))
    with pytest.raises(ValueError, match="pipeline_granularity must be one of"):
        config("halves")


def test_a_subclass_that_changes_blocks_must_finish_its_layers():
    class Custom(GPT):
        def __init__(self, config):
            super().__init__(config, seed=0)

    Custom(config("block")).pipeline_layers()  # block granularity: nothing to finish
    with pytest.raises(RuntimeError, match=r"self._layers_built\(Custom\)"):
        Custom(config("sublayer")).pipeline_layers()


def test_pruning_picks_the_halves():
    _, sub = pair()
    picked = [default_prunable_layer(i, l, len(sub.layers)) for i, l in enumerate(sub.layers)]
    assert picked == [False] + [True] * 6 + [False, False]


def test_whole_units_rounds_to_block_boundaries():
    _, sub = pair()  # units (0, 1, 1, 2, 2, 3, 3, 4, 5)
    assert [whole_units(sub, n, up=True) for n in range(10)] == [0, 1, 3, 3, 5, 5, 7, 7, 8, 9]
    assert [whole_units(sub, n, up=False) for n in range(10)] == [0, 1, 1, 3, 3, 5, 5, 7, 8, 9]
    block = GPT(config("block"), seed=0)
    assert [whole_units(block, n, up=True) for n in range(6)] == list(range(6))


def _frozen(model) -> list[bool]:
    return [all(not p.requires_grad for p in l.parameters()) for l in model.layers]


def _fit(model, callbacks, steps=2, ckpt=None, root=None):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        callbacks=callbacks, default_root_dir=root)
    x, y = data(0, b=8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt)
    return trainer


def test_freezing_a_block_freezes_both_of_its_pieces(tmp_path):
    """A schedule asking for 2 pipeline layers (embedding + block 0's attention half) freezes the
    whole of block 0; the frozen prefix saved in the callback's state is in blocks, so a block-
    granularity run resumed from it freezes the same parameters."""
    _, sub = pair()
    freezing = LayerFreezing(schedule={0: 2})
    trainer = _fit(sub, [freezing])
    assert _frozen(sub) == [True, True, True, False, False, False, False, False, False]
    assert freezing.n_frozen == 3
    trainer.save_checkpoint(tmp_path / "sub.ckpt")
    block = GPT(config("block"), seed=0)
    resumed = LayerFreezing(schedule={0: 2})
    _fit(block, [resumed], steps=3, ckpt=str(tmp_path / "sub.ckpt"), root=tmp_path)
    assert _frozen(block) == [True, True, False, False, False, False] and resumed.n_frozen == 2
    for k, v in torch.load(tmp_path / "sub.ckpt", weights_only=False)["state_dict"].items():
        if k.startswith(("layers.0.", "layers.1.")):
            assert torch.equal(block.state_dict()[k], v), k  # frozen: unchanged by the resumed steps


def test_hparams_and_lightning_checkpoint_load_at_the_other_granularity(tmp_path):
    _, sub = pair(seed=9)
    trainer = _fit(sub, [], steps=1)
    trainer.save_checkpoint(tmp_path / "sub.ckpt")
    ckpt = torch.load(tmp_path / "sub.ckpt", weights_only=False)
    assert list(ckpt["state_dict"]) == list(GPT(config("block"), seed=0).state_dict())
    loaded = GPT.load_from_checkpoint(tmp_path / "sub.ckpt", config=config("block"))
    assert len(loaded.layers) == BASE["n_layer"] + 3
    assert_same_model(loaded, sub)
    assert isinstance(GPT.load_from_checkpoint(tmp_path / "sub.ckpt").layers[1], AttentionHalf)
    assert isinstance(loaded.layers[1], Block)


def test_pruned_sublayer_gpt_trains_and_checkpoints_as_the_block_gpt(tmp_path):
    """Global magnitude pruning to 90 % with CSR storage: the halves are pruned like their blocks
    (same threshold, masks, losses and weights), and the checkpoint -- masks and the densified
    optimizer state of the CSR-stored weights included -- is the block model's, bit for bit."""
    from lightning_dynmo.callbacks import GradualPruning
    from lightning_dynmo.dynamic import PrunableLinear

    out = {}
    for g in ("block", "sublayer"):
        model = GPT(config(g), seed=0, warmup_steps=1, max_steps=12)
        cb = GradualPruning(final_sparsity=0.9, start_step=1, n_steps=2, frequency=2, storage_density=0.5,
                            sparse_kernels=False)
        losses = LossRecorder()
        trainer = _fit(model, [cb, losses], steps=6)
        assert all(m.compressed for m in model.modules() if isinstance(m, PrunableLinear))
        trainer.save_checkpoint(tmp_path / f"{g}.ckpt")
        out[g] = (losses.losses, torch.load(tmp_path / f"{g}.ckpt", weights_only=False), cb.sparsity)
    (la, ca, sa), (lb, cb_, sb) = out["block"], out["sublayer"]
    assert la == lb and sa == sb == pytest.approx(0.9, abs=5e-3)
    assert list(ca["state_dict"]) == list(cb_["state_dict"])
    assert any(k.endswith("weight_mask") for k in ca["state_dict"])
    for k, v in ca["state_dict"].items():
        assert torch.equal(v, cb_["state_dict"][k]), k
    oa, ob = ca["optimizer_states"][0], cb_["optimizer_states"][0]
    assert oa["state"].keys() == ob["state"].keys()
    for i, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)




def test_load_monitors_watch_the_halves_that_do_the_work():
    """The per-layer monitors report under the pipeline index of the half holding the work: the
    attention halves for block density, the MoE half for expert load."""
    from lightning_dynmo.callbacks import MoELoadMonitor, SparseAttentionMonitor

    sparse = GPT(config("sublayer", attention="hash_sparse", nb_hash=2, attention_block=16), seed=0)
    attn = SparseAttentionMonitor(shift_threshold=10.0)
    _fit(sparse, [attn], steps=1)
    assert sorted(attn.last_stats) == [1, 3, 5]
    moe = MoEGPT(config("sublayer"), moe=dict(num_experts=4, top_k=2, moe_every=2), seed=0)
    experts = MoELoadMonitor(shift_threshold=10.0)
    _fit(moe, [experts], steps=1)
    assert sorted(experts.last_stats) == [4] and experts.last_stats[4]["load"] == pytest.approx(1.0)
