"""The ``transformers`` architectures :class:`~lightning_dynmo.models.hf.HFCausalLM` can split
into pipeline layers, and where each keeps its embeddings, decoder layers, norm and head;
re-exported by :mod:`lightning_dynmo.models.hf`.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError"]


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
