"""The GPT's settings: :class:`GPTConfig`, its presets and the choices it validates.

Apart from the layers, so that the layers, the granularity and the attention variants can all
read a config without importing the model (and a config can be checked without model code).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dynmo.sparse.attention import BACKENDS
from lightning_dynmo.sparse.hash_layout import HASH_CENTERS

from .._config import ModelConfig
from ...protocol.granularity import GRANULARITIES, check_granularity

__all__ = ["ATTENTION_KINDS", "GRANULARITIES", "GPTConfig", "check_granularity"]

# Attention per block: "dense" (SDPA, causal) or "hash_sparse" (hash-bucketed block-sparse
# attention, lightning_dynmo.sparse.hash_layout: a token sees earlier tokens of its bucket).
ATTENTION_KINDS = ("dense", "hash_sparse")
# what the pipeline layers are made of (gpt/granularity.py)


@dataclass
class GPTConfig(ModelConfig):
    """Shape and pipeline layout of a :class:`~lightning_dynmo.models.GPT`; ``from_any`` also takes a
    preset name (:meth:`preset`)."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    mlp_ratio: float = 4
    # Optional per-block MLP width ratio (len == n_layer) for heterogeneous layer stacks.
    mlp_ratios: tuple | None = None
    # "dense" | "hash_sparse" for every block, or a tuple with one entry per block.
    attention: str | tuple = "dense"
    attention_block: int = 64  # layout block size of hash_sparse attention (kernels: 16/32/64/128)
    nb_hash: int | tuple = 4  # hash buckets per head (density ~ 1 / nb_hash), or one entry per block
    hash_redraw: bool = False  # new hash rotations every training step (default: fixed per layer)
    # what the hash sees: "causal" = keys minus their running mean over positions <= t, so a
    # direction all keys share (training grows one) does not send every token to one bucket;
    # "causal_std" also divides by the running std; "none" = the raw keys
    hash_center: str = "causal"
    # "auto" (FlexAttention on CUDA, our kernels on the CPU) | "kernel" | "flex"
    attention_backend: str = "auto"
    # GPT-2's weight tying: the LM head uses the token embedding's matrix (one parameter, used by
    # the first and the last pipeline layer; DynMoStrategy keeps one copy per owning rank and sums
    # their gradients before each step, Megatron's way)
    tie_embeddings: bool = False
    # the LM head + cross-entropy as this many pipeline layers over vocabulary slices, streaming
    # an online softmax (models/vocab_head.py): the full logits never exist; 1 = one Head layer
    head_chunks: int = 1
    # what the pipeline's layers are: "block" (whole transformer blocks), "sublayer" (each
    # block's attention half and MLP half are separate layers) or "fine" (five pieces per block,
    # cut inside the halves; models/gpt/granularity.py)
    pipeline_granularity: str = "block"

    def __post_init__(self) -> None:
        if self.mlp_ratios is not None:
            self.mlp_ratios = tuple(self.mlp_ratios)  # lists from YAML/OmegaConf become tuples
            if len(self.mlp_ratios) != self.n_layer:
                raise ValueError(
                    f"mlp_ratios has {len(self.mlp_ratios)} entries but n_layer={self.n_layer}"
                )
        if not isinstance(self.attention, str):
            self.attention = tuple(self.attention)  # lists from YAML/OmegaConf become tuples
            if len(self.attention) != self.n_layer:
                raise ValueError(f"attention has {len(self.attention)} entries but n_layer={self.n_layer}")
        for kind in (self.attention,) if isinstance(self.attention, str) else self.attention:
            if kind not in ATTENTION_KINDS:
                raise ValueError(f"attention must be one of {ATTENTION_KINDS} (or a per-layer tuple), got {kind!r}")
        if not isinstance(self.nb_hash, (int, float)):
            self.nb_hash = tuple(self.nb_hash)  # lists from YAML/OmegaConf become tuples
            if len(self.nb_hash) != self.n_layer:
                raise ValueError(f"nb_hash has {len(self.nb_hash)} entries but n_layer={self.n_layer}")
        for nb in (self.nb_hash,) if isinstance(self.nb_hash, (int, float)) else self.nb_hash:
            if int(nb) != nb or nb < 1:
                raise ValueError(f"nb_hash must be an integer >= 1 (or a per-layer tuple of them), got {nb!r}")
        if self.hash_center not in HASH_CENTERS:
            raise ValueError(f"hash_center must be one of {HASH_CENTERS}, got {self.hash_center!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if int(self.attention_block) != self.attention_block or self.attention_block < 1:
            raise ValueError(f"attention_block must be a positive integer, got {self.attention_block!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be True or False, got {self.tie_embeddings!r}")
        check_granularity(self.pipeline_granularity, self.head_chunks, self.vocab_size)
        if self.head_chunks > 1 and self.tie_embeddings:
            raise ValueError("tie_embeddings=True needs head_chunks=1: a chunked head splits the LM head's matrix "
                             "into one parameter per vocabulary slice, which cannot be the embedding's one matrix; "
                             "untie the embedding or use one head chunk")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def block_mlp_ratio(self, i: int) -> float:
        return self.mlp_ratio if self.mlp_ratios is None else self.mlp_ratios[i]

    def layer_attention(self, i: int) -> str:
        return self.attention if isinstance(self.attention, str) else self.attention[i]

    def layer_nb_hash(self, i: int) -> int:
        return int(self.nb_hash if isinstance(self.nb_hash, (int, float)) else self.nb_hash[i])

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """Named sizes. ``overrides`` replace preset fields (e.g. ``vocab_size=256`` for bytes)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid presets: {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})


_PRESETS: dict[str, dict[str, Any]] = {
    # unit tests: milliseconds per step
    "tiny": dict(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32),
    # README main job on 2 CPU cores (~2.7M params, byte-level)
    "small-cpu": dict(vocab_size=256, block_size=128, n_layer=6, n_head=6, n_embd=192),
    # GPT-2 sizes (vocab padded to 50304 like nanoGPT); override vocab_size=256 for byte data
    "gpt2": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
}
