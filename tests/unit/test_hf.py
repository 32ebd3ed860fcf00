"""The Hugging Face adapter (lightning_dynmo.models.hf): the pipeline layers compute exactly the
``transformers`` model, weights load per layer from a local directory and save back to the same
format, and bad checkpoints or architectures are refused by name. Tiny random models, no network."""
from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_dynmo.models.hf import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    CheckpointMismatchError,
    HFCausalLM,
    HFDecoderLayer,
    UnsupportedArchitectureError,
    router_balance_loss,
)
from lightning_dynmo.protocol import RemoteLayer, pipeline_layers_of  # noqa: E402
from lightning_dynmo.runtime.materialize import materialize_pipeline  # noqa: E402

SMALL = dict(vocab_size=64, bos_token_id=0, eos_token_id=0)


def configs():
    return {
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, **SMALL),
        "llama": transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          **SMALL),
        # a window shorter than the sequence: the wrapper must build Mistral's sliding-window mask
        "mistral": transformers.MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64, sliding_window=6, **SMALL),
        # Mistral + a top-2 of 4 experts MoE block in every layer
        "mixtral": transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                              num_experts_per_tok=2, max_position_embeddings=64, sliding_window=6,
                                              **SMALL),
        # Llama's layout with q/k/v biases (Qwen2) or q/k norms (Qwen3) inside the decoder layer
        "qwen2": transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          **SMALL),
        "qwen3": transformers.Qwen3Config(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          max_position_embeddings=32, **SMALL),
        # Llama's outer layout: fused qkv / gate_up and a sliding window shorter than the sequence (Phi-3),
        # LayerNorm with biases, a window and embedding dropout (Starcoder2, its head tied by default),
        # post-norms and q/k norms (OLMo 2), non-parametric LayerNorm (OLMo), partial rotary and
        # LayerNorm (StableLM), Helium
        "phi3": transformers.Phi3Config(**LLAMA_LIKE, sliding_window=6, pad_token_id=0),
        "starcoder2": transformers.Starcoder2Config(**LLAMA_LIKE, sliding_window=6),
        "olmo2": transformers.Olmo2Config(**LLAMA_LIKE),
        "olmo": transformers.OlmoConfig(**LLAMA_LIKE),
        "stablelm": transformers.StableLmConfig(**LLAMA_LIKE),
        "helium": transformers.HeliumConfig(**LLAMA_LIKE, head_dim=8),
        # scales outside the modules: Gemma's embedding scale lives in its embedding module; soft-capped
        # logits, per-layer sliding windows and (Gemma 3) a rotary table per layer type; Granite's
        # embedding multiplier and logit divisor; Cohere's logit scale (Cohere 2: per-layer windows too)
        "gemma": transformers.GemmaConfig(**LLAMA_LIKE, head_dim=8),
        "gemma2": transformers.Gemma2Config(**LLAMA_LIKE, head_dim=8, sliding_window=6, final_logit_softcapping=0.5,
                                            attn_logit_softcapping=2.0),
        "gemma3_text": transformers.Gemma3TextConfig(**LLAMA_LIKE, head_dim=8, sliding_window=6,
                                                     layer_types=["sliding_attention", "full_attention"],
                                                     final_logit_softcapping=0.5),
        "granite": transformers.GraniteConfig(**LLAMA_LIKE, embedding_multiplier=3.0, logits_scaling=4.0,
                                              residual_multiplier=0.5, attention_multiplier=0.3),
        "cohere": transformers.CohereConfig(**LLAMA_LIKE, logit_scale=0.25),
        "cohere2": transformers.Cohere2Config(**LLAMA_LIKE, sliding_window=6, logit_scale=0.25,
                                              layer_types=["sliding_attention", "full_attention"]),
        "ministral": transformers.MinistralConfig(**LLAMA_LIKE, head_dim=8, sliding_window=6,
                                                  layer_types=["sliding_attention", "full_attention"]),
        "olmo3": transformers.Olmo3Config(**LLAMA_LIKE, sliding_window=6,
                                          layer_types=["sliding_attention", "full_attention"]),
        "smollm3": transformers.SmolLM3Config(**LLAMA_LIKE, pad_token_id=0, use_sliding_window=True, sliding_window=6,
                                              layer_types=["sliding_attention", "full_attention"],
                                              no_rope_layers=[1, 0]),  # the second layer without rotary
        # GPT-NeoX (Pythia): its own module names, parallel residual, partial rotary; the head is embed_out on disk
        "gpt_neox": transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                               num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
                                               **SMALL),
        # more of Llama's layout (EXAONE 4 with a window on every other layer); Phi-2's LayerNorm and biased head
        "exaone4": transformers.Exaone4Config(**LLAMA_LIKE, head_dim=8, sliding_window=6, sliding_window_pattern=2),
        "glm": transformers.GlmConfig(**LLAMA_LIKE, head_dim=8, pad_token_id=0),
        "glm4": transformers.Glm4Config(**LLAMA_LIKE, head_dim=8, pad_token_id=0),
        "seed_oss": transformers.SeedOssConfig(**LLAMA_LIKE, head_dim=8),
        "arcee": transformers.ArceeConfig(**LLAMA_LIKE, head_dim=8),
        "apertus": transformers.ApertusConfig(**LLAMA_LIKE, head_dim=8),
        "ernie4_5": transformers.Ernie4_5Config(**LLAMA_LIKE, head_dim=8),
        "nemotron": transformers.NemotronConfig(**LLAMA_LIKE, head_dim=8),
        "hunyuan_v1_dense": transformers.HunYuanDenseV1Config(**LLAMA_LIKE, head_dim=8),
        "phi": transformers.PhiConfig(**LLAMA_LIKE, partial_rotary_factor=0.5),
        # Qwen's optional sliding-window layers (from max_window_layers on)
        "qwen2_window": transformers.Qwen2Config(**LLAMA_LIKE, use_sliding_window=True, sliding_window=6,
                                                 max_window_layers=1),
    }


LLAMA_LIKE = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **SMALL)


def saved(tmp_path, arch: str, **save_kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs()[arch]).eval()
    path = tmp_path / arch
    model.save_pretrained(path, **save_kw)
    return model, path


def load(path, **kw) -> HFCausalLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HFCausalLM.from_pretrained(path, **kw)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "starcoder2",
                                  "olmo2", "olmo", "stablelm", "helium", "gemma", "gemma2", "gemma3_text", "granite",
                                  "cohere", "cohere2", "ministral", "olmo3", "smollm3", "qwen2_window", "gpt_neox",
                                  "exaone4", "glm", "glm4", "seed_oss", "arcee", "apertus", "ernie4_5", "nemotron",
                                  "hunyuan_v1_dense", "phi"])
def test_pipeline_layers_compute_the_transformers_model(tmp_path, arch):
    ref, path = saved(tmp_path, arch)
    model = load(path).eval()
    layers = pipeline_layers_of(model)
    assert len(layers) == ref.config.num_hidden_layers + 3
    assert all(isinstance(layers[i], HFDecoderLayer) for i in range(1, len(layers) - 2))
    x = torch.randint(0, 64, (2, 16))
    h = x
    with torch.no_grad():
        for layer in layers:  # one tensor in, one tensor out: what a pipeline stage passes on
            h = layer(h)
            assert isinstance(h, torch.Tensor)
        assert torch.equal(h, ref(x).logits)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral", "qwen2", "phi3", "starcoder2", "gemma", "gemma3_text",
                                  "granite", "gpt_neox"])
def test_each_rank_reads_only_its_layers_and_gets_the_real_build_values(tmp_path, arch, monkeypatch):
    _, path = saved(tmp_path, arch)
    real = load(path).state_dict()
    with torch.device("meta"):
        model = load(path)
    assert all(p.is_meta for p in model.parameters())
    read = []
    original = type(model._checkpoint).read
    monkeypatch.setattr(type(model._checkpoint), "read", lambda self, keys: read.extend(keys) or original(self, keys))
    layers = model.pipeline_layers()
    own = [2, 3]  # the second decoder layer and the final norm (a tied GPT-2 head would read wte)
    for i in range(len(layers)):
        if i not in own:
            layers[i] = RemoteLayer(i)
    materialize_pipeline(model, layers, own)
    state = model.state_dict()
    assert set(state) == {k for k in real if int(k.split(".")[1]) in own}
    assert all(torch.equal(v, real[k]) for k, v in state.items())
    embed = {"gpt2": "transformer.wte.weight", "gpt_neox": "gpt_neox.embed_in.weight"}.get(arch,
                                                                                          "model.embed_tokens.weight")
    assert read and embed not in read and not any(re.search(r"\.(h|layers)\.0\.", k) for k in read), read  # not ours


def test_gpt2_tied_head_is_untied_with_a_warning_and_saves_untied(tmp_path):
    ref, path = saved(tmp_path, "gpt2")
    assert ref.config.tie_word_embeddings
    with pytest.warns(UserWarning, match="untied for the pipeline"):
        model = HFCausalLM.from_pretrained(path)
    emb, head = model.layers[0].wte.weight, model.layers[-1].lm_head.weight
    assert emb is not head and torch.equal(emb, head)
    with torch.no_grad():
        head.add_(1.0)  # trains separately from now on
    out = tmp_path / "saved"
    model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(back(x).logits, model.eval()(x))
    kept = load(path, untie_embeddings=False)
    assert kept.layers[0].wte.weight is kept.layers[-1].lm_head.weight
    kept.save_pretrained(tmp_path / "tied")
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("save_kw", [{"safe_serialization": False}, {"max_shard_size": "20KB"}],
                         ids=["pytorch_model.bin", "sharded-safetensors"])
def test_other_checkpoint_layouts_load(tmp_path, save_kw):
    ref, path = saved(tmp_path, "llama", **save_kw)
    model = load(path).eval()
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x).logits)


def test_save_pretrained_of_a_pipeline_rank_needs_the_full_state(tmp_path):
    _, path = saved(tmp_path, "llama")
    model = load(path)
    full = model.state_dict()
    model.layers[1] = RemoteLayer(1)
    with pytest.raises(ValueError, match="lightning_module_state_dict"):
        model.save_pretrained(tmp_path / "part")
    model.save_pretrained(tmp_path / "full", state_dict=full)  # e.g. rank 0's gathered state
    assert torch.equal(load(tmp_path / "full").state_dict()["layers.1.layer.mlp.up_proj.weight"],
                       full["layers.1.layer.mlp.up_proj.weight"])


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    _, path = saved(tmp_path, "gpt2")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    assert supported.startswith("apertus, arcee, cohere, cohere2, ")
    assert "gemma3_text, glm, glm4, gpt2, gpt_neox" in supported
    with pytest.raises(UnsupportedArchitectureError, match=rf"model_type='falcon'.*supported: {supported}\. To train "
                       r"another architecture on the pipeline, wrap it in a LightningModule that "
                       r"defines pipeline_layers"):
        HFCausalLM.from_pretrained(path)
    with pytest.raises(UnsupportedArchitectureError, match="'bert'"):
        HFCausalLM(config={"model_type": "bert"})


def test_attention_kinds_without_a_mask_here_are_refused(tmp_path):
    """Only full and sliding-window causal attention are built; any other layer type (Llama 4's chunked
    attention) or Gemma 3's bidirectional variant would run silently as another model."""
    _, path = saved(tmp_path, "qwen2")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention", "chunked_attention"]}))
    with pytest.raises(UnsupportedArchitectureError, match=r"qwen2 with layer_types \['chunked_attention'\]"):
        load(path)
    with pytest.raises(UnsupportedArchitectureError, match="use_bidirectional_attention=True"):
        HFCausalLM(config={**configs()["gemma3_text"].to_dict(), "use_bidirectional_attention": True})


def test_scaled_logits_refuse_a_chunked_head():
    with pytest.raises(ValueError, match="head_chunks > 1 does not support granite's logit scaling"):
        HFCausalLM(config=configs()["granite"].to_dict(), head_chunks=2)


# (arch, a config change whose tensor shapes differ, its message, one that leaves a tensor missing, its message);
# Mixtral's experts are checked per stored tensor (experts.{e}.w1), not per fused parameter
MISMATCHES = {
    "llama": ({"intermediate_size": 40},
              r"model.layers.0.mlp.gate_proj.weight: checkpoint \[48, 32\], config \[40, 32\]",
              {"num_hidden_layers": 3}, r"missing: \['model.layers.2"),
    "mixtral": ({"intermediate_size": 40},
                r"model.layers.0.block_sparse_moe.experts.0.w1.weight: checkpoint \[48, 32\], config \[40, 32\]",
                {"num_local_experts": 5}, r"missing: \['model.layers.0.mlp.experts.gate_up_proj"),
}


@pytest.mark.parametrize("arch", sorted(MISMATCHES))
def test_checkpoint_that_does_not_match_its_config_is_refused_by_name(tmp_path, arch):
    _, path = saved(tmp_path, arch)
    cfg = json.loads((path / "config.json").read_text())
    shape_change, shape_msg, missing_change, missing_msg = MISMATCHES[arch]
    (path / "config.json").write_text(json.dumps({**cfg, **shape_change}))
    with pytest.raises(CheckpointMismatchError, match=shape_msg):
        HFCausalLM.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({**cfg, **missing_change}))
    with pytest.raises(CheckpointMismatchError, match=missing_msg):
        HFCausalLM.from_pretrained(path)


def test_random_init_from_a_config_is_per_layer_and_meta_safe():
    cfg = {"model_type": "llama", **configs()["llama"].to_diff_dict()}
    a = HFCausalLM(config=cfg, seed=1)
    b = HFCausalLM(config=cfg, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with torch.device("meta"):
        m = HFCausalLM(config=cfg, seed=1)
    materialize_pipeline(m, m.pipeline_layers(), range(len(m.pipeline_layers())))
    assert all(torch.equal(x, a.state_dict()[k]) for k, x in m.state_dict().items())
    rotary = m.layers[1].rotary.inv_freq
    assert torch.equal(rotary, a.layers[1].rotary.inv_freq) and not rotary.is_meta
    norm = a.layers[1].layer.input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))  # the model's own init rules
    assert not torch.equal(a.layers[1].layer.mlp.up_proj.weight,
                           HFCausalLM(config=cfg, seed=2).layers[1].layer.mlp.up_proj.weight)


# ------------------------------------------------------------------ Mixtral
@pytest.mark.parametrize("arch", ["gpt_neox", "gemma3_text", "granite", "cohere2"])
def test_what_the_adapter_saves_transformers_loads_with_the_same_names_and_logits(tmp_path, arch):
    """Trained weights written by save_pretrained: the published tensor names (GPT-NeoX's head as embed_out),
    and transformers' model computes the adapter's logits (scales, soft-caps and per-layer masks included)."""
    _, path = saved(tmp_path, arch)
    model = load(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = tmp_path / "saved"
    model.save_pretrained(out)
    from safetensors import safe_open

    untied = {"lm_head.weight"} if model._tied else set()  # Gemma and Cohere tie theirs: saved untied
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(path / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys()) | untied
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(back(x).logits, model.eval()(x))


def test_mixtral_round_trip_through_the_published_per_expert_format(tmp_path):
    """transformers 5 fuses Mixtral's experts in its modules but stores them per expert (w1/w3/w2
    under block_sparse_moe): the adapter reads that format, writes it back (the same tensor names
    transformers writes), and also reads a file of fused module tensors."""
    ref, path = saved(tmp_path, "mixtral")
    model = load(path)
    with torch.no_grad():  # trained weights: every expert tensor differs from the saved one
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = tmp_path / "saved"
    model.save_pretrained(out)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(path / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in set(f.keys())
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = model.hf_state_dict()
    theirs = back.state_dict()
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], v) for k, v in ours.items())
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(back(x).logits, model.eval()(x))
    fused = tmp_path / "fused"  # a file of module tensors (e.g. a raw state_dict dump)
    ref.config.save_pretrained(fused)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(fused / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(load(fused).eval()(x), ref(x).logits)


def test_router_balance_loss_is_transformers_loss_of_one_layer_and_one_row():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(3, 16, 4)
    per_row = [load_balancing_loss_func((row,), 4, 2) for row in logits]
    assert torch.allclose(router_balance_loss(logits, 2), torch.stack(per_row).mean(), rtol=1e-6)
    # HF pools layers (and rows) before multiplying: the mean of per-layer products differs from it
    # by E * sum_i cov_l(f_i, P_i), the documented relation
    layers = torch.randn(3, 16, 4)
    pooled = load_balancing_loss_func(tuple(layers), 4, 2)
    probs = layers.softmax(-1)
    f = torch.zeros_like(probs).scatter_(2, probs.topk(2, -1).indices, 1.0).mean(1)  # [L, E]
    p = probs.mean(1)
    cov = ((f - f.mean(0)) * (p - p.mean(0))).mean(0)
    per_layer = torch.stack([router_balance_loss(layer[None], 2) for layer in layers]).mean()
    assert torch.allclose(per_layer, pooled + 4 * cov.sum(), rtol=1e-5)
    assert not torch.allclose(per_layer, pooled, rtol=1e-3)


def _mixtral_grads(model, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {model._hf_key(int(n.split(".")[1]), n.split(".", 2)[2]): p.grad for n, p in model.named_parameters()}


def test_mixtral_router_loss_gradients_are_the_mean_of_transformers_per_layer_per_row_losses(tmp_path):
    """Training gradients of the adapter = those of CE + coef * mean over layers and rows of
    ``load_balancing_loss_func`` on that layer's and row's router logits (from transformers' own
    model, output_router_logits=True); off by default, as transformers' own (the config's
    output_router_logits=False)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    ref, path = saved(tmp_path, "mixtral")
    coef = 0.5
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    ref.train()
    out = ref(x, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    aux = torch.stack([load_balancing_loss_func((row,), 4, 2) for layer in out.router_logits
                       for row in layer.view(3, 16, 4)]).mean()
    ref.zero_grad()
    (ce + coef * aux).backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    model = load(path, config={"router_aux_loss_coef": coef}, router_aux_loss=True).train()
    got = _mixtral_grads(model, x, y)
    assert set(got) == set(want)
    for k, g in got.items():
        assert torch.allclose(g, want[k], rtol=1e-4, atol=1e-7), k
    router = "model.layers.1.mlp.gate.weight"
    off = _mixtral_grads(load(path, config={"router_aux_loss_coef": coef}).train(), x, y)
    assert not torch.allclose(off[router], got[router], rtol=1e-3)  # the default is off...
    on = _mixtral_grads(load(path, config={"router_aux_loss_coef": coef, "output_router_logits": True}).train(), x, y)
    assert torch.equal(on[router], got[router])  # ...and follows output_router_logits
    with pytest.raises(ValueError, match="needs an MoE model"):
        load(saved(tmp_path, "llama")[1], router_aux_loss=True)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_config_with_fewer_layers_than_the_weights_is_refused(tmp_path, arch):
    """The layers beyond the config's count are refused, not dropped without a word."""
    _, path = saved(tmp_path, arch)
    cfg = json.loads((path / "config.json").read_text())
    key = "n_layer" if arch == "gpt2" else "num_hidden_layers"
    (path / "config.json").write_text(json.dumps({**cfg, key: 1}))
    with pytest.raises(CheckpointMismatchError,
                       match=r"beyond the config's 1, which would be dropped: \['[a-z.]*\b(h|layers)\.1\."):
        HFCausalLM.from_pretrained(path)


@pytest.mark.parametrize("keep", [100, 0.5])
def test_a_truncated_safetensors_file_is_named(tmp_path, keep):
    """The error names the file: safetensors' own error does not say which file."""
    from lightning_dynmo.models.hf.checkpoint import CheckpointFileError

    _, path = saved(tmp_path, "llama")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(CheckpointFileError, match=rf"{re.escape(str(file))} cannot be read .*truncated or damaged"):
        HFCausalLM.from_pretrained(path)
