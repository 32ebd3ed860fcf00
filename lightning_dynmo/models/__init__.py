"""Models that implement the dynmo pipeline protocol (``pipeline_layers`` / ``pipeline_loss``)."""
from lightning_dynmo.models.gpt import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    FinalNorm,
    GPTConfig,
    Head,
    WarmupCosine,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "Embedding",
    "Block",
    "FinalNorm",
    "Head",
    "CausalSelfAttention",
    "MLP",
    "WarmupCosine",
]
