"""The vocabulary-chunked LM head (GPTConfig(head_chunks=k)): the streaming loss equals the
unchunked head's loss and gradients, under fp32, bf16 autocast and Lightning's mixed precision,
with targets ignored (-100) as the unchunked cross-entropy ignores them. (The Hugging Face
adapter's chunked head: tests/unit/test_hf_chunked_head.py.)"""
from __future__ import annotations

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.models.early_exit import EarlyExitGPT
from lightning_dynmo.models.vocab_head import HeadChunk, chunk_bounds
from lightning_dynmo.protocol.merges import merge_optimizer_state, merge_state, split_optimizer_state


def _pair(vocab: int, k: int, **kw) -> tuple[GPT, GPT]:
    cfg = dict(vocab_size=vocab, block_size=8, n_layer=1, n_head=2, n_embd=16, **kw)
    return GPT(GPTConfig(**cfg), seed=3), GPT(GPTConfig(**cfg, head_chunks=k), seed=3)


def _merged_grads(model: GPT) -> dict[str, torch.Tensor]:
    """Parameter gradients by unchunked name (the chunks' rows concatenated)."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return merge_state(grads, model.checkpoint_merges())


def _loss_and_grads(model: GPT, x, y) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model.lm_loss(x, y)
    loss.backward()
    return loss.detach(), _merged_grads(model)


@settings(derandomize=True, max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(0, 40), st.integers(1, 3))
def test_chunked_loss_and_gradients_equal_the_unchunked_head(k, extra, batch):
    vocab = k + extra  # sizes not divisible by k included
    plain, chunked = _pair(vocab, k)
    assert plain.state_dict().keys() == chunked.state_dict().keys()  # one head matrix in checkpoints
    x = torch.randint(0, vocab, (batch, 8), generator=torch.Generator().manual_seed(k + extra))
    y = torch.randint(0, vocab, (batch, 8), generator=torch.Generator().manual_seed(k * extra + 1))
    want, want_g = _loss_and_grads(plain, x, y)
    got, got_g = _loss_and_grads(chunked, x, y)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert want_g.keys() == got_g.keys()
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(chunked(x), plain(x))  # sampling's logits, built from the slices


@pytest.mark.parametrize("k", [2, 3])
def test_ignored_targets_are_ignored_as_by_the_unchunked_cross_entropy(k):
    """Targets equal to -100 (F.cross_entropy's ignore_index, which the unchunked head uses) count
    neither in the chunked loss's sum nor in its mean, and give no gradient."""
    plain, chunked = _pair(50, k)
    x = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(8))
    y[0, 5:] = -100
    y[2, ::3] = -100
    want, want_g = _loss_and_grads(plain, x, y)
    got, got_g = _loss_and_grads(chunked, x, y)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    full = _loss_and_grads(plain, x, torch.where(y == -100, x, y))[0]
    assert abs(float(full) - float(want)) > 1e-4  # the ignored positions would have changed the mean
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_bf16_autocast_is_close_to_the_unchunked_head():
    plain, chunked = _pair(96, 4)
    x = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))
    ref, ref_g = _loss_and_grads(plain, x, y)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = _loss_and_grads(plain, x, y)
        got, got_g = _loss_and_grads(chunked, x, y)
    assert abs(float(got) - float(ref)) < 2e-2 and abs(float(got) - float(want)) < 2e-2
    for name, g in ref_g.items():
        # the chunked head's error against fp32 is no larger than the unchunked bf16 head's (plus slack)
        err, base = (got_g[name] - g).norm(), (want_g[name] - g).norm()
        assert err <= 2 * base + 2e-2 * g.norm(), (name, float(err), float(base), float(g.norm()))


class _Grads(L.Callback):
    """Gradients as the optimizer sees them (after the grad scaler's unscale), by unchunked name."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = _merged_grads(pl_module)
        self.grads = {k: v.detach().float().clone() for k, v in self.grads.items()}


def _one_lightning_step(model: GPT, precision, tmp_path) -> dict[str, torch.Tensor]:
    data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(5))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    record = _Grads()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[record],
                        **({"plugins": [precision]} if precision else {}))
    trainer.fit(model, loader)
    return record.grads


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_mixed_precision_gradients_match_the_unchunked_head(precision, tmp_path):
    """One step under Lightning's mixed precision (16-mixed: the fp16 plugin with a grad scaler,
    as ``precision="16-mixed"`` becomes bf16 on the CPU): the chunked head's gradients are as
    close to the fp32 ones as the unchunked head's under the same precision."""
    def plugin():
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if precision == "16-mixed" else None
        return MixedPrecision(precision, "cpu", scaler=scaler)

    plain, chunked = _pair(64, 3)
    fp32 = _one_lightning_step(_pair(64, 3)[0], None, tmp_path)
    want = _one_lightning_step(plain, plugin(), tmp_path)
    got = _one_lightning_step(chunked, plugin(), tmp_path)
    assert got.keys() == want.keys() == fp32.keys()
    for name, g in fp32.items():
        err, base = (got[name] - g).norm(), (want[name] - g).norm()
        assert err <= 2 * base + 2e-2 * g.norm(), (name, float(err), float(base), float(g.norm()))


def test_chunk_bounds_cover_the_vocabulary_evenly():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(5, 5) == [(j, j + 1) for j in range(5)]
    with pytest.raises(ValueError, match="head_chunks must be an integer between 1 and vocab_size=4"):
        chunk_bounds(4, 5)


def test_state_dicts_translate_between_chunk_counts():
    plain, chunked = _pair(50, 4)
    chunked.load_state_dict(plain.state_dict())
    for (a, b), layer in zip(chunk_bounds(50, 4), chunked.layers[chunked.head_index:]):
        torch.testing.assert_close(layer.lm_head.weight, plain.layers[-1].lm_head.weight[a:b])
    other = _pair(50, 1)[0]
    torch.nn.init.zeros_(other.layers[-1].lm_head.weight)
    other.load_state_dict(chunked.state_dict())
    torch.testing.assert_close(other.layers[-1].lm_head.weight, plain.layers[-1].lm_head.weight)


def test_optimizer_state_translates_between_chunk_counts():
    """AdamW's state of a chunked model, in the merged naming, is the unchunked model's."""
    plain, chunked = _pair(50, 3)
    x = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    sds, names = [], []
    for model in (plain, chunked):
        opt = model.configure_optimizers()["optimizer"]
        model.lm_loss(x, x).backward()
        opt.step()
        fqn = {id(p): n for n, p in model.named_parameters()}
        order = [fqn[id(p)] for g in opt.param_groups for p in g["params"]]
        names.append(dict(enumerate(order)))
        sds.append(opt.state_dict())
    merges = chunked.checkpoint_merges()
    merged = merge_optimizer_state(sds[1], names[1], merges)
    assert [g["params"] for g in merged["param_groups"]] == [g["params"] for g in sds[0]["param_groups"]]
    for i, state in sds[0]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(merged["state"][i][key], state[key], rtol=1e-5, atol=1e-9)
    groups = [g["params"] for g in sds[1]["param_groups"]]
    back = split_optimizer_state(merged, names[1], groups, merges)
    assert back["state"].keys() == sds[1]["state"].keys()
    steps = [state["step"] for state in back["state"].values()]  # Adam updates them in place: one each
    assert len({id(t) for t in steps}) == len(steps)
    for i, state in sds[1]["state"].items():
        torch.testing.assert_close(back["state"][i]["exp_avg"], state["exp_avg"])


def test_unsupported_combinations_are_refused_clearly():
    with pytest.raises(ValueError, match="tie_embeddings=True needs head_chunks=1"):
        GPTConfig(head_chunks=2, tie_embeddings=True)
    with pytest.raises(ValueError, match="head_chunks must be an integer between 1 and vocab_size=256"):
        GPTConfig(head_chunks=0)
    with pytest.raises(ValueError, match="EarlyExitGPT does not support head_chunks > 1"):
        EarlyExitGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, head_chunks=2))


def test_the_chunks_are_separate_layers_with_their_own_rows():
    model = GPT(GPTConfig(vocab_size=30, block_size=8, n_layer=2, n_head=2, n_embd=16, head_chunks=3), seed=0)
    chunks = list(model.pipeline_layers())[model.head_index:]
    assert len(model.pipeline_layers()) == 2 + 2 + 3 and all(isinstance(c, HeadChunk) for c in chunks)
    assert [c.lm_head.weight.shape[0] for c in chunks] == [10, 10, 10]
    assert [(c.first, c.last) for c in chunks] == [(True, False), (False, False), (False, True)]


def test_dcp_writes_pieces_as_rows_of_one_tensor_and_reads_them_into_another_split(tmp_path):
    """``runtime/dcp_rows.py`` in one process: a 3-way split saved (with an ordinary entry and a
    nested optimizer-like entry), read back into a 2-way split, and consolidated by DCP's own
    loader as whole tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lightning_dynmo.runtime.dcp_rows import RowPieces, RowPiecesLoadPlanner, RowPiecesSavePlanner

    w, m = torch.randn(10, 3), torch.randn(10, 3)
    state = {"model": {"a": torch.ones(2), "w": RowPieces(w.shape, [(0, w[:4]), (4, w[4:7]), (7, w[7:])])},
             "opt": {"state": {"w": {"exp_avg": RowPieces(m.shape, [(7, m[7:]), (0, m[:7])]),
                                     "step": torch.tensor(3.0)}}}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), planner=RowPiecesSavePlanner())
    md = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    assert (tuple(md["model.w"].size), len(md["model.w"].chunks)) == ((10, 3), 3)
    whole: dict = {}
    _load_state_dict(whole, storage_reader=dcp.FileSystemReader(tmp_path), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    assert torch.equal(whole["model"]["w"], w) and torch.equal(whole["opt"]["state"]["w"]["exp_avg"], m)
    pieces, a = [torch.zeros(6, 3), torch.zeros(4, 3)], torch.zeros(2)
    rows = {"model.w": RowPieces(w.shape, [(0, pieces[0]), (6, pieces[1])])}
    dcp.load({"model.a": a}, storage_reader=dcp.FileSystemReader(tmp_path), planner=RowPiecesLoadPlanner(rows))
    assert torch.equal(torch.cat(pieces), w) and torch.equal(a, torch.ones(2))
    with pytest.raises(CheckpointException, match=r"the pieces are rows of \[12, 3\]"):  # wraps the ValueError
        dcp.load({}, storage_reader=dcp.FileSystemReader(tmp_path),
                 planner=RowPiecesLoadPlanner({"model.w": RowPieces(torch.Size([12, 3]), [(0, pieces[0])])}))
