"""``pipeline_granularity="fine"``: five pieces per block passing (intermediate, residual stream)
pairs compute the block GPT's function bit for bit (init, loss, gradients, logits), keep its
state-dict keys so checkpoints cross every granularity, and models that cannot be cut that finely
refuse at construction, naming what to use instead."""
from __future__ import annotations

import pytest
import torch

from lightning_dynmo.models import FINE_PIECES, GPT, EarlyExitGPT, MoDGPT, MoEGPT
from lightning_dynmo.protocol import state_dict_key
from tests.unit.test_granularity import BASE, config, data


@pytest.mark.parametrize("head_chunks", [1, 3])
def test_fine_gpt_is_the_block_gpt_bit_for_bit(head_chunks):
    block, fine = (GPT(config(g, head_chunks=head_chunks), seed=11) for g in ("block", "fine"))
    n = BASE["n_layer"]
    assert len(fine.pipeline_layers()) == 5 * n + 2 + head_chunks
    assert [type(x) for x in fine.layers[1:6]] == list(FINE_PIECES)
    assert fine.pipeline_layer_units()[1:1 + 5 * n] == tuple(1 + i // 5 for i in range(5 * n))
    sb, sf = block.state_dict(), fine.state_dict()
    assert list(sb) == list(sf) and all(torch.equal(sb[k], sf[k]) for k in sb)  # init, incl. residual projections
    assert [state_dict_key(fine, k) for k, _ in fine.named_parameters()] == [k for k, _ in block.named_parameters()]
    idx, tgt = data()
    lb, lf = block.lm_loss(idx, tgt), fine.lm_loss(idx, tgt)
    lb.backward(), lf.backward()
    assert torch.equal(lb, lf)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(block.parameters(), fine.parameters()))
    assert torch.equal(block(idx), fine(idx))


def test_checkpoints_cross_every_granularity():
    ref = GPT(config("block"), seed=1)
    state = ref.state_dict()
    for a, b in (("fine", "sublayer"), ("sublayer", "fine"), ("fine", "block")):
        m = GPT(config(a), seed=2)
        m.load_state_dict(state)
        state = m.state_dict()
        other = GPT(config(b), seed=3)
        other.load_state_dict(state)
        assert all(torch.equal(x, y) for x, y in zip(ref.parameters(), other.parameters())), (a, b)


def test_a_cut_inside_a_half_passes_the_stream_beside_the_intermediate():
    fine = GPT(config("fine"), seed=0)
    x = torch.randn(2, 16, BASE["n_embd"], requires_grad=True)
    qkv, stream = fine.layers[1](x)
    assert qkv.shape[-1] == 3 * BASE["n_embd"] and torch.equal(stream, x) and stream is not x
    a, stream = fine.layers[4](fine.layers[3](*fine.layers[2](qkv, stream)))
    assert a.shape[-1] == BASE["mlp_ratios"][0] * BASE["n_embd"]


def test_models_that_cannot_be_cut_finely_refuse():
    with pytest.raises(ValueError, match="EarlyExitGPT does not support pipeline_granularity='fine'"):
        EarlyExitGPT(config("fine"))
    with pytest.raises(ValueError, match="MoDGPT does not support pipeline_granularity='fine'"):
        MoDGPT(config("fine"), mod=dict(every=1))
    with pytest.raises(ValueError, match="cannot be split into fine pipeline layers.*'sublayer' or 'block'"):
        MoEGPT(config("fine"))
    with pytest.raises(ValueError, match="cannot be split into fine pipeline layers.*'sublayer' or 'block'"):
        GPT(config("fine", attention="hash_sparse", attention_block=16))
