"""Models that implement the dynmo pipeline protocol (``pipeline_layers`` / ``pipeline_loss``).

One sub-package per model family, each with its own ``config`` module: ``gpt`` (the base GPT,
its layers, pipeline granularity and hash-sparse attention), ``moe`` (mixture of experts),
``mod`` (mixture of depths) and ``hf`` (Hugging Face models; not imported here, it needs
``transformers``). ``early_exit`` and ``vocab_head`` (the LM head as vocabulary chunks) sit beside
them; ``_lm``, ``_config``, ``_aux_loss`` and ``_packing`` are shared helpers. Nothing here imports
``lightning_dynmo.runtime``: what a layer needs from the runtime comes through
:mod:`lightning_dynmo.protocol`.
"""
from .early_exit import EarlyExitGPT, ExitBlock, ExitEmbedding, ExitFinalNorm
from ._lm import WarmupCosine
from .gpt import (
    FINE_PIECES,
    GPT,
    GRANULARITIES,
    MLP,
    AttentionHalf,
    Block,
    CausalSelfAttention,
    Embedding,
    FinalNorm,
    GPTConfig,
    HashSparseSelfAttention,
    Head,
    MLPHalf,
    SparseAttentionBlock,
    SparseAttentionHalf,
)
from .mod import MoDBlock, MoDConfig, MoDGPT
from .moe import MoEBlock, MoEConfig, MoEGPT, MoEHalf, MoELayer
from .vocab_head import HeadChunk

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
    "MoEBlock",
    "MoEConfig",
    "MoEGPT",
    "MoELayer",
    "MoDBlock",
    "MoDConfig",
    "MoDGPT",
    "HashSparseSelfAttention",
    "SparseAttentionBlock",
    "HeadChunk",
    "FINE_PIECES",
    "GRANULARITIES",
    "AttentionHalf",
    "MLPHalf",
    "MoEHalf",
    "SparseAttentionHalf",
]
