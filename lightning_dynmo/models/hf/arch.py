"""The ``transformers`` architectures :class:`~lightning_dynmo.models.hf.HFCausalLM` can split
into pipeline layers, and where each keeps its embeddings, decoder layers, norm and head;
re-exported by :mod:`lightning_dynmo.models.hf`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "load_config"]


@dataclass(frozen=True)
class _Arch:
    embeddings: tuple[tuple[str, str], ...]  # (attribute on HFEmbedding, module path in the HF model)
    layers: str  # the decoder ModuleList
    norm: str
    head: str = "lm_head"
    rotary: str | None = None  # the model-level rotary embedding, copied into each decoder layer
    embed_dropout: str | None = None  # config attribute with the embedding dropout
    # every layer attends within config.sliding_window (when set); a config that lists layer_types
    # (Gemma 2/3, Cohere 2, Ministral, OLMo 3, SmolLM3, Qwen with use_sliding_window) says it per layer
    sliding_window: bool = False
    router: str | None = None  # a decoder layer's top-k MoE router, returning (logits, weights, experts)
    # scales the model's own forward applies outside its modules (config attribute names)
    embedding_multiplier: str | None = None  # embeddings * it (Granite)
    logit_divisor: str | None = None  # logits / it (Granite)
    logit_multiplier: str | None = None  # logits * it (Cohere)
    logit_softcap: str | None = None  # tanh(logits / cap) * cap (Gemma 2/3)

    def embedding_scale(self, cfg) -> float | None:
        """The embedding multiplier's value in ``cfg`` (``None``: none)."""
        return _config_value(cfg, self.embedding_multiplier)

    def logit_scales(self, cfg) -> tuple[float | None, float | None, float | None]:
        """``(divisor, multiplier, softcap)`` of the logits in ``cfg`` (``None``: none)."""
        return tuple(_config_value(cfg, n) for n in (self.logit_divisor, self.logit_multiplier, self.logit_softcap))


def _config_value(cfg, name: str | None) -> float | None:
    value = getattr(cfg, name, None) if name else None
    return None if value is None else float(value)


_LLAMA_FIELDS = dict(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                     rotary="model.rotary_emb")
_LLAMA = _Arch(**_LLAMA_FIELDS)

SUPPORTED_ARCHITECTURES: dict[str, _Arch] = {
    "gpt2": _Arch(embeddings=(("wte", "transformer.wte"), ("wpe", "transformer.wpe")), layers="transformer.h",
                  norm="transformer.ln_f", embed_dropout="embd_pdrop"),
    "llama": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                   rotary="model.rotary_emb"),
    "mistral": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                     rotary="model.rotary_emb", sliding_window=True),
    "mixtral": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                     rotary="model.rotary_emb", sliding_window=True, router="mlp.gate"),
    # Llama's layout (Qwen2 adds q/k/v biases, Qwen3 q/k norms, both inside the decoder layer); their
    # optional per-layer sliding windows are refused (see _check_layer_types)
    "qwen2": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                   rotary="model.rotary_emb"),
    "qwen3": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                   rotary="model.rotary_emb"),
    # Llama's layout too: whatever differs (fused qkv/gate_up, post-norms, q/k norms, partial rotary,
    # LayerNorm, biases, Gemma's scaled embedding module, Granite's residual multiplier) lives inside the
    # embedding, the decoder layer or the final norm, which run as they are; the scales the model's own
    # forward applies outside its modules are the fields above. Each is checked against transformers'
    # logits bitwise (tests/unit/test_hf.py).
    "phi3": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                  rotary="model.rotary_emb", sliding_window=True),  # its window: config.sliding_window, if set
    "starcoder2": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers",
                        norm="model.norm", rotary="model.rotary_emb", embed_dropout="embedding_dropout",
                        sliding_window=True),
    "olmo": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                  rotary="model.rotary_emb"),
    "olmo2": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                   rotary="model.rotary_emb"),
    "stablelm": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                      rotary="model.rotary_emb"),
    "helium": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers", norm="model.norm",
                    rotary="model.rotary_emb"),
    # GPT-NeoX (Pythia): its own names; published files call the head embed_out (checkpoint.DISK_LAYOUTS)
    "gpt_neox": _Arch(embeddings=(("embed_in", "gpt_neox.embed_in"),), layers="gpt_neox.layers",
                      norm="gpt_neox.final_layer_norm", rotary="gpt_neox.rotary_emb", embed_dropout="hidden_dropout"),
    "gemma": _LLAMA,
    "gemma2": _Arch(**_LLAMA_FIELDS, logit_softcap="final_logit_softcapping"),
    "gemma3_text": _Arch(**_LLAMA_FIELDS, logit_softcap="final_logit_softcapping"),  # a rotary per layer type
    "granite": _Arch(**_LLAMA_FIELDS, embedding_multiplier="embedding_multiplier", logit_divisor="logits_scaling"),
    "cohere": _Arch(**_LLAMA_FIELDS, logit_multiplier="logit_scale"),
    "cohere2": _Arch(**_LLAMA_FIELDS, logit_multiplier="logit_scale"),
    "ministral": _LLAMA,
    "olmo3": _LLAMA,
    "smollm3": _LLAMA,
    "exaone4": _LLAMA,
    "glm": _LLAMA,
    "glm4": _LLAMA,
    "seed_oss": _LLAMA,
    "arcee": _LLAMA,
    "apertus": _LLAMA,
    "ernie4_5": _LLAMA,
    "nemotron": _LLAMA,
    "hunyuan_v1_dense": _LLAMA,
    # Phi-1/1.5/2: partial rotary, LayerNorm, a head with a bias
    "phi": _Arch(embeddings=(("embed_tokens", "model.embed_tokens"),), layers="model.layers",
                 norm="model.final_layernorm", rotary="model.rotary_emb", embed_dropout="embd_pdrop"),
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's ``model_type`` is not one the adapter can split into pipeline layers."""


def _check_architecture(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"HFCausalLM does not support model_type={model_type!r} (from {where}); supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. To train another architecture on the pipeline, wrap it "
            "in a LightningModule that defines pipeline_layers() and pipeline_loss() (docs/model_protocol.md; "
            "lightning_dynmo.models.GPT is one). Adding a name to SUPPORTED_ARCHITECTURES is not enough: an "
            "architecture's embedding, positions and norms differ (OPT offsets its positions by 2), and each supported "
            "one is tested equal to transformers' own forward (tests/unit/test_hf.py)"
        )


def load_config(path: str | None, overrides: dict | None, attn_implementation: str | None):
    """The ``PretrainedConfig`` of the model directory ``path`` (with ``overrides`` applied), or
    one built from ``overrides`` (which then name the ``model_type``); its architecture checked and
    its attention backend set (``None``: :func:`default_attention`)."""
    from transformers import AutoConfig

    if path is not None:
        if not (Path(path) / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        raw = json.loads((Path(path) / "config.json").read_text())
        _check_architecture(raw.get("model_type"), f"{path}/config.json")
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        for k, v in (overrides or {}).items():
            setattr(cfg, k, v)
    else:
        if not overrides or "model_type" not in overrides:
            raise ValueError("HFCausalLM needs a path, or a config with its model_type")
        _check_architecture(overrides["model_type"], "config")
        fields = {k: v for k, v in overrides.items() if k != "model_type"}
        cfg = AutoConfig.for_model(overrides["model_type"], **fields)
    _check_layer_types(cfg)
    cfg._attn_implementation = attn_implementation or default_attention(cfg)
    return cfg


def default_attention(cfg) -> str:
    """``"sdpa"`` where the architecture's model class supports it, else ``"eager"`` (Gemma 2: SDPA
    cannot soft-cap the attention logits)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return "sdpa" if getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], "_supports_sdpa", False) else "eager"


LAYER_KINDS = {"full_attention": False, "sliding_attention": True}  # kind -> sliding-window mask


def layer_kinds(cfg) -> list[tuple[str | None, bool]]:
    """``(layer type, sliding window?)`` of each decoder layer, as the model's own forward picks
    its masks: from ``config.layer_types`` where the config lists them (``None`` as the type where
    it does not), else from the architecture (every layer, when ``config.sliding_window`` is set)."""
    arch = SUPPORTED_ARCHITECTURES[cfg.model_type]
    types = getattr(cfg, "layer_types", None)
    window = bool(getattr(cfg, "sliding_window", None))
    if not types:
        return [(None, arch.sliding_window and window)] * cfg.num_hidden_layers
    return [(t, LAYER_KINDS[t] and window) for t in types[:cfg.num_hidden_layers]]


def _check_layer_types(cfg) -> None:
    """Attention kinds the adapter cannot build a mask for (anything but full and sliding-window
    causal attention) are refused rather than run as another model."""
    kinds = set(getattr(cfg, "layer_types", None) or ()) - set(LAYER_KINDS)
    if kinds:
        raise UnsupportedArchitectureError(
            f"HFCausalLM does not support {cfg.model_type} with layer_types {sorted(kinds)}: it builds full or "
            "sliding-window causal attention only. Use a config whose layer_types are full_attention or "
            "sliding_attention")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(
            f"HFCausalLM does not support {cfg.model_type} with use_bidirectional_attention=True (an encoder, "
            "not a causal LM); set it to False")
