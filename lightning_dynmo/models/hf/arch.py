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
    sliding_window: bool = False
    router: str | None = None  # a decoder layer's top-k MoE router, returning (logits, weights, experts)


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
    # LayerNorm, biases) lives inside the decoder layer or the final norm, which run as they are.
    # Checked against transformers' logits bitwise (tests/unit/test_hf.py). Architectures that scale
    # the embedding, the residual or the logits outside the layers (Gemma, Granite, Cohere) are not here.
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
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's ``model_type`` is not one the adapter can split into pipeline layers."""


def _check_architecture(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"HFCausalLM does not support model_type={model_type!r} (from {where}); supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. Their decoder layers are split into pipeline layers "
            "by lightning_dynmo.models.hf.SUPPORTED_ARCHITECTURES"
        )


def load_config(path: str | None, overrides: dict | None, attn_implementation: str | None):
    """The ``PretrainedConfig`` of the model directory ``path`` (with ``overrides`` applied), or
    one built from ``overrides`` (which then name the ``model_type``); its architecture checked."""
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
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    return cfg


def _check_layer_types(cfg) -> None:
    """A config that mixes attention kinds per layer (Qwen2/Qwen3 with ``use_sliding_window``) is
    refused where the adapter builds one mask kind for every layer: it would run those layers with
    full attention, silently another model."""
    arch = SUPPORTED_ARCHITECTURES[cfg.model_type]
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if arch.sliding_window or kinds <= {"full_attention"}:
        return
    raise UnsupportedArchitectureError(
        f"HFCausalLM does not support {cfg.model_type} with layer_types {sorted(kinds)} (sliding-window layers, "
        "e.g. use_sliding_window=True): it builds full causal attention for every layer of this architecture. "
        "Use a config without sliding-window layers")
