"""The GPT family's base: config, single-tensor layers, pipeline granularity, hash-sparse attention
and the model. Modules depend one way: ``config`` <- ``layers`` <- ``granularity`` <-
``hash_attention`` <- ``model``."""
from .config import ATTENTION_KINDS, GRANULARITIES, GPTConfig
from .granularity import FINE_PIECES, AttentionHalf, MLPHalf
from .hash_attention import HashSparseSelfAttention, SparseAttentionBlock, SparseAttentionHalf, set_hash_step
from .layers import MLP, Block, CausalSelfAttention, Embedding, FinalNorm, Head
from .model import GPT

__all__ = [
    "ATTENTION_KINDS",
    "FINE_PIECES",
    "GPT",
    "GPTConfig",
    "GRANULARITIES",
    "AttentionHalf",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "FinalNorm",
    "HashSparseSelfAttention",
    "Head",
    "MLP",
    "MLPHalf",
    "SparseAttentionBlock",
    "SparseAttentionHalf",
    "set_hash_step",
]
