"""Padding in the Hugging Face adapter: ``HFCausalLM(pad_token_id=p)`` carries ``keep = ids != p``
beside the hidden state (a tuple activation) and every decoder layer masks padding keys as the
``transformers`` model's own forward does for ``attention_mask=keep``."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_dynmo.models.hf import HFCausalLM, HFPaddedDecoderLayer  # noqa: E402
from lightning_dynmo.protocol import pipeline_layers_of  # noqa: E402
from lightning_dynmo.protocol.activations import run_layers  # noqa: E402
from tests.unit.test_hf import configs, load, saved  # noqa: E402

PAD = 63


def padded_batch(side: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, PAD, (3, 16), generator=g)  # no accidental padding
    if side == "left":
        ids[0, :5], ids[1, :2] = PAD, PAD
    else:
        ids[0, -5:], ids[1, -2:] = PAD, PAD
    return ids


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral", "mixtral", "gemma2", "gemma3_text", "qwen2_window"])
def test_real_tokens_see_what_the_transformers_model_sees_with_its_attention_mask(tmp_path, arch, side):
    ref, path = saved(tmp_path, arch)
    model = load(path, pad_token_id=PAD).eval()
    ids = padded_batch(side)
    keep = ids != PAD
    with torch.no_grad():
        ours = model(ids)
        theirs = ref(ids, attention_mask=keep.long()).logits
        unmasked = load(path).eval()(ids)
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-5, atol=1e-5)
    if side == "left":  # the mask matters: without it the real tokens attend to the padding
        assert not torch.allclose(unmasked[keep], theirs[keep], atol=1e-3)
    else:  # causal attention: right padding is never a key of a real token
        torch.testing.assert_close(unmasked[keep], theirs[keep], rtol=1e-5, atol=1e-5)


def test_the_flag_rides_beside_the_hidden_state_and_ends_at_the_norm(tmp_path):
    _, path = saved(tmp_path, "llama")
    model = load(path, pad_token_id=PAD)
    layers = pipeline_layers_of(model)
    ids = padded_batch("left")
    h = layers[0](ids)
    assert isinstance(h, tuple) and h[1].dtype == h[0].dtype and not h[1].requires_grad
    assert torch.equal(h[1].bool(), ids != PAD)
    assert all(isinstance(layers[i], HFPaddedDecoderLayer) for i in range(1, len(layers) - 2))
    out = layers[1](*h)
    assert isinstance(out, tuple) and torch.equal(out[1], h[1])
    assert isinstance(layers[-2](*out), torch.Tensor)


@pytest.mark.parametrize("chunks", [1, 3])
def test_padding_composes_with_a_chunked_head_and_checkpoints_do_not_change(tmp_path, chunks):
    _, path = saved(tmp_path, "llama")
    plain = load(path)
    model = load(path, pad_token_id=PAD, head_chunks=chunks)
    assert model.state_dict().keys() == plain.state_dict().keys()
    ids = padded_batch("left")
    targets = torch.roll(ids, -1, dims=1).masked_fill(ids == PAD, -100)
    loss = model.pipeline_loss(run_layers(pipeline_layers_of(model), model.pipeline_inputs(ids, targets)), targets)
    ref = load(path, pad_token_id=PAD)
    expected = torch.nn.functional.cross_entropy(ref(ids).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [-1, 64, 1.5, True, "0"])
def test_a_pad_id_outside_the_vocabulary_is_refused(tmp_path, bad):
    _, path = saved(tmp_path, "gpt2")
    with pytest.raises((ValueError, TypeError), match="pad_token_id"):
        load(path, pad_token_id=bad)


def test_the_pad_id_survives_hyperparameters(tmp_path):
    model = HFCausalLM(config={"model_type": "llama", **configs()["llama"].to_dict()}, pad_token_id=PAD)
    assert model.hparams["pad_token_id"] == PAD
