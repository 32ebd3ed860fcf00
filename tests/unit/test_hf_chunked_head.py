"""The Hugging Face adapter's vocabulary-chunked LM head (``HFCausalLM(head_chunks=k)``): the
streaming loss and every gradient equal the unchunked head's (GPT-2, Llama, Mistral; ``k`` dividing
the vocabulary or not; targets ignored with -100), bf16 autocast stays close, the checkpoint names
one ``lm_head.weight`` (state dicts and the ``transformers`` export are those of the unchunked
model), and an unsupported tied head is refused by name. Tiny random models, no network."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lightning_dynmo.models.hf import HFCausalLM  # noqa: E402
from lightning_dynmo.models.vocab_head import HeadChunk  # noqa: E402
from lightning_dynmo.protocol import RemoteLayer  # noqa: E402
from lightning_dynmo.runtime.materialize import materialize_pipeline  # noqa: E402
from lightning_dynmo.protocol.merges import merge_state  # noqa: E402
from tests.unit.test_hf import configs, load  # noqa: E402

V = 64  # the tiny configs' vocabulary: 3 chunks of it are 22, 21, 21 rows


def saved(tmp_path, arch: str, **overrides):
    """A tiny random ``transformers`` model saved in ``tmp_path/arch`` (GPT-2 untied unless asked,
    without dropout, so training-mode runs compare exactly)."""
    config = configs()[arch]
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if arch == "gpt2" else {}
    for k, v in {"tie_word_embeddings": False, **no_dropout, **overrides}.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / arch
    model.save_pretrained(path)
    return model, path


def batch(seed: int = 0, ignored: bool = True):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (3, 12), generator=g), torch.randint(0, V, (3, 12), generator=g)
    if ignored:  # padding-style targets: a row's tail and scattered positions
        y[0, 8:] = -100
        y[2, ::5] = -100
    return x, y


def loss_and_grads(model: HFCausalLM, x, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss and every parameter's gradient by unchunked name (the chunks' rows joined)."""
    model.zero_grad(set_to_none=True)
    loss = model.lm_loss(x, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return loss.detach(), merge_state(grads, model.checkpoint_merges())


@pytest.mark.parametrize("arch,k", [("gpt2", 2), ("gpt2", 3), ("llama", 2), ("llama", 3), ("mistral", 2),
                                    ("mistral", 3), ("mixtral", 3)])
def test_chunked_loss_and_gradients_equal_the_unchunked_head(tmp_path, arch, k):
    """(Mixtral: with its per-layer router loss on, attached in backward.)"""
    _, path = saved(tmp_path, arch, **({"output_router_logits": True, "router_aux_loss_coef": 0.5}
                                        if arch == "mixtral" else {}))
    plain, chunked = load(path).train(), load(path, head_chunks=k).train()
    layers = chunked.pipeline_layers()
    assert len(layers) == len(plain.pipeline_layers()) - 1 + k
    assert all(isinstance(c, HeadChunk) for c in layers[-k:]) and not isinstance(layers[-k - 1], HeadChunk)
    assert sum(c.lm_head.weight.shape[0] for c in layers[-k:]) == V
    x, y = batch()
    want, want_g = loss_and_grads(plain, x, y)
    got, got_g = loss_and_grads(chunked, x, y)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # and the unchunked loss is transformers' own cross-entropy over the same targets
    torch.testing.assert_close(want, F.cross_entropy(plain(x).flatten(0, 1), y.flatten()), rtol=0, atol=0)
    assert got_g.keys() == want_g.keys()
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(chunked(x), plain(x))  # logits built from the slices (inspection)


def test_ignored_targets_count_neither_in_the_sum_nor_the_mean(tmp_path):
    _, path = saved(tmp_path, "llama")
    plain, chunked = load(path), load(path, head_chunks=3)
    x, y = batch(1)
    keep = y != -100
    per_token = F.cross_entropy(plain(x).flatten(0, 1), y.clamp(min=0).flatten(), reduction="none").view_as(y)
    expected = per_token[keep].mean()
    torch.testing.assert_close(chunked.lm_loss(x, y), expected, rtol=1e-6, atol=1e-6)
    # the ignored positions get no gradient: the chunked gradients are those of the masked mean
    _, got = loss_and_grads(chunked, x, y)
    plain.zero_grad(set_to_none=True)
    per_token = F.cross_entropy(plain(x).flatten(0, 1), y.clamp(min=0).flatten(), reduction="none")
    per_token[keep.flatten()].mean().backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    every = torch.full_like(y, -100)  # nothing left to average: NaN, as F.cross_entropy
    assert torch.isnan(chunked.lm_loss(x, every)) and torch.isnan(plain.lm_loss(x, every))


def test_bf16_autocast_is_finite_and_close_to_the_unchunked_head(tmp_path):
    _, path = saved(tmp_path, "llama")
    plain, chunked = load(path), load(path, head_chunks=3)
    x, y = batch(2)
    ref, ref_g = loss_and_grads(plain, x, y)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = loss_and_grads(plain, x, y)
        got, got_g = loss_and_grads(chunked, x, y)
    assert torch.isfinite(got) and abs(float(got) - float(ref)) < 2e-2 and abs(float(got) - float(want)) < 2e-2
    for name, g in ref_g.items():
        assert torch.isfinite(got_g[name]).all(), name
        # no further from fp32 than the unchunked head under the same autocast (plus slack)
        err, base = (got_g[name] - g).norm(), (want_g[name] - g).norm()
        assert err <= 2 * base + 2e-2 * g.norm(), (name, float(err), float(base), float(g.norm()))


def test_a_tied_head_is_chunked_after_untying_and_refused_when_kept_tied(tmp_path):
    """GPT-2's default ties the head to the embedding: the adapter unties it for the pipeline
    (``untie_embeddings=True``), then chunks the untied copy, which trains exactly as the
    unchunked untied head; keeping it tied cannot be chunked and is refused with the fixes."""
    ref, path = saved(tmp_path, "gpt2", tie_word_embeddings=True)
    assert ref.config.tie_word_embeddings
    plain, chunked = load(path), load(path, head_chunks=3)
    head = chunked.state_dict()["layers.4.lm_head.weight"]
    assert torch.equal(head, chunked.layers[0].wte.weight)  # the copy of the embedding, in 3 slices
    x, y = batch(3)
    want, want_g = loss_and_grads(plain, x, y)
    got, got_g = loss_and_grads(chunked, x, y)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    message = (r"head_chunks=2 needs an LM head of its own.*untie_embeddings=True.*tie_word_embeddings=False"
               r".*head_chunks=1")
    with pytest.raises(ValueError, match=message):
        load(path, head_chunks=2, untie_embeddings=False)
    cfg = {"model_type": "llama", **configs()["llama"].to_diff_dict(), "tie_word_embeddings": True}
    with pytest.raises(ValueError, match=message):
        HFCausalLM(config=cfg, head_chunks=2, untie_embeddings=False)


@pytest.mark.parametrize("bad", [0, V + 1, 1.5, True])
def test_head_chunks_must_be_an_integer_within_the_vocabulary(tmp_path, bad):
    cfg = {"model_type": "llama", **configs()["llama"].to_diff_dict()}
    with pytest.raises(ValueError, match=f"head_chunks must be an integer between 1 and vocab_size={V}"):
        HFCausalLM(config=cfg, head_chunks=bad)


@pytest.mark.parametrize("arch", ["gpt2", "mistral"])
def test_state_dicts_are_the_unchunked_models_and_load_both_ways(tmp_path, arch):
    _, path = saved(tmp_path, arch)
    plain, chunked = load(path), load(path, head_chunks=3)
    head = "layers.4.lm_head.weight"  # embedding, 2 decoder layers, final norm, head
    assert chunked.state_dict().keys() == plain.state_dict().keys() and head in plain.state_dict()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in chunked.state_dict().items())
    with torch.no_grad():  # "trained" weights, then each model loads the other's checkpoint
        for p in chunked.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    other = load(path)
    other.load_state_dict(chunked.state_dict())
    x, y = batch(4)
    with torch.no_grad():
        torch.testing.assert_close(other(x), chunked(x))
        torch.testing.assert_close(other.lm_loss(x, y), chunked.lm_loss(x, y), rtol=1e-6, atol=1e-6)
    again = load(path, head_chunks=2)  # and into another chunk count
    again.load_state_dict(other.state_dict())
    assert [c.lm_head.weight.shape[0] for c in again.layers[-2:]] == [32, 32]
    with torch.no_grad():
        torch.testing.assert_close(again(x), chunked(x))


def test_save_pretrained_of_a_chunked_model_loads_into_transformers(tmp_path):
    _, path = saved(tmp_path, "llama")
    chunked = load(path, head_chunks=3)
    with torch.no_grad():
        for p in chunked.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert set(chunked.hf_state_dict()) == set(load(path).hf_state_dict())
    out = tmp_path / "saved"
    chunked.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x, y = batch(5)
    with torch.no_grad():
        logits = back(x).logits
        torch.testing.assert_close(logits, chunked.eval()(x))
        torch.testing.assert_close(F.cross_entropy(logits.flatten(0, 1), y.flatten()), chunked.lm_loss(x, y))
        torch.testing.assert_close(load(out, head_chunks=2)(x), logits)  # and back with another chunk count


@pytest.mark.parametrize("init", ["checkpoint", "random"])
def test_each_rank_materialises_its_chunks_with_the_real_build_values(tmp_path, init):
    """Meta-device build: a rank owning only the last two chunks reads (or draws) the whole head
    and keeps its rows, the values a real build gives them, without touching the global RNG."""
    _, path = saved(tmp_path, "llama")
    cfg = {"model_type": "llama", **configs()["llama"].to_diff_dict()}
    build = ((lambda **kw: load(path, **kw)) if init == "checkpoint"
             else (lambda **kw: HFCausalLM(config=cfg, seed=7, **kw)))
    real, plain = build(head_chunks=3), build()
    with torch.device("meta"):
        model = build(head_chunks=3)
    layers = model.pipeline_layers()
    own = [len(layers) - 2, len(layers) - 1]
    for i in range(len(layers)):
        if i not in own:
            layers[i] = RemoteLayer(i)
    rng = torch.get_rng_state()
    materialize_pipeline(model, layers, own)
    assert torch.equal(torch.get_rng_state(), rng)
    for i in own:
        assert torch.equal(layers[i].lm_head.weight, real.layers[i].lm_head.weight)
    rows = torch.cat([real.layers[i].lm_head.weight for i in range(len(layers) - 3, len(layers))])
    assert torch.equal(rows, plain.layers[-1].lm_head.weight)  # the unchunked head's initial values
