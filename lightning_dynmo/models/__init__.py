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
from lightning_dynmo.models.early_exit import EarlyExitGPT, ExitBlock, ExitEmbedding, ExitFinalNorm

__all__ = [
    "EarlyExitGPT",
    "ExitBlock",
    "ExitEmbedding",
    "ExitFinalNorm",
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
from lightning_dynmo.models.moe import MoEBlock, MoEConfig, MoEGPT, MoELayer

__all__ += ["MoEBlock", "MoEConfig", "MoEGPT", "MoELayer"]

from lightning_dynmo.models.mod import MoDBlock, MoDConfig, MoDGPT

__all__ += ["MoDBlock", "MoDConfig", "MoDGPT"]

from lightning_dynmo.models.gpt import HashSparseSelfAttention, SparseAttentionBlock

__all__ += ["HashSparseSelfAttention", "SparseAttentionBlock"]

from lightning_dynmo.models.vocab_head import HeadChunk

__all__ += ["HeadChunk"]

from lightning_dynmo.models.granularity import FINE_PIECES, GRANULARITIES, AttentionHalf, MLPHalf
from lightning_dynmo.models.hash_attention import SparseAttentionHalf
from lightning_dynmo.models.moe import MoEHalf

__all__ += ["FINE_PIECES", "GRANULARITIES", "AttentionHalf", "MLPHalf", "MoEHalf", "SparseAttentionHalf"]
