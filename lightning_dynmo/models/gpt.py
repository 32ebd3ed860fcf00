"""nanoGPT-style pre-LN decoder laid out as an ordered list of single-tensor layers.

The dynmo strategy splits ``pipeline_layers()`` into contiguous stages and passes exactly one
activation tensor between them, so every layer here maps one tensor to one tensor:

    [Embedding(tok+pos)] + [Block] * n_layer + [FinalNorm] + [Head]      (L = n_layer + 3)

Pipeline protocol (what the strategy relies on):

* ``pipeline_layers()`` returns the registered ``self.layers`` ModuleList (same object each call).
  The model keeps no other reference to a layer (no aliases, no weight tying), so the strategy
  may swap entries it does not own for placeholders.
* ``pipeline_loss(output, target)``: mean token cross-entropy, a scalar.
* Batches are ``(inputs, targets)`` int64 ``[B, T]`` tuples.
* ``configure_optimizers()`` only looks at ``self.parameters()`` (trainable ones), so it works on
  any subset of layers; decay/no-decay membership is a rule on the parameter (``ndim >= 2``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dynmo.sparse.attention import BACKENDS
from lightning_dynmo.sparse.hash_layout import HASH_CENTERS, draw_rotations, hash_sparse_attention
from lightning_dynmo.models._lm import CausalLMModule, WarmupCosine
from lightning_dynmo.runtime.materialize import layer_seed

__all__ = [
    "GPTConfig",
    "Embedding",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "FinalNorm",
    "Head",
    "GPT",
    "WarmupCosine",
    "HashSparseSelfAttention",
    "SparseAttentionBlock",
    "set_hash_step",
    "ATTENTION_KINDS",
]

# Attention per block: "dense" (SDPA, causal) or "hash_sparse" (hash-bucketed block-sparse
# attention, lightning_dynmo.sparse.hash_layout: a token sees earlier tokens of its bucket).
ATTENTION_KINDS = ("dense", "hash_sparse")


@dataclass
class GPTConfig:
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

    def to_dict(self) -> dict:
        """Plain dict (tuples -> lists) so checkpoints/hparams.yaml stay portable."""
        d = dataclasses.asdict(self)
        if d["mlp_ratios"] is not None:
            d["mlp_ratios"] = list(d["mlp_ratios"])
        if not isinstance(d["attention"], str):
            d["attention"] = list(d["attention"])
        if isinstance(d["nb_hash"], tuple):
            d["nb_hash"] = list(d["nb_hash"])
        return d

    @classmethod
    def from_any(cls, config: "GPTConfig | Mapping | str | None") -> "GPTConfig":
        """Accept a GPTConfig, a (OmegaConf) mapping, a preset name, or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, GPTConfig):
            return dataclasses.replace(config)
        if isinstance(config, str):
            return cls.preset(config)
        if isinstance(config, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(config) - fields
            if unknown:
                raise ValueError(f"unknown GPTConfig keys {sorted(unknown)}; valid: {sorted(fields)}")
            return cls(**{k: config[k] for k in config})
        raise TypeError(f"config must be GPTConfig, dict, preset name or None, got {type(config)}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """Named sizes. ``overrides`` replace preset fields (e.g. ``vocab_size=256`` for bytes)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid presets: {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(_PRESETS)


_PRESETS: dict[str, dict[str, Any]] = {
    # unit tests: milliseconds per step
    "tiny": dict(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32),
    # README main job on 2 CPU cores (~2.7M params, byte-level)
    "small-cpu": dict(vocab_size=256, block_size=128, n_layer=6, n_head=6, n_embd=192),
    # GPT-2 sizes (vocab padded to 50304 like nanoGPT); override vocab_size=256 for byte data
    "gpt2": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
}


class Embedding(nn.Module):
    """Layer 0: token + learned position embedding, ``idx [B,T] int64 -> [B,T,C]``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # plain nn.Linear attributes so a pruning callback can find them
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, ratio: float):
        super().__init__()
        hidden = max(1, int(round(ratio * config.n_embd)))
        self.fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class RunningMean:
    """Mean of the values added since :meth:`reset` (``None`` before the first)."""

    __slots__ = ("total", "count")

    def __init__(self) -> None:
        self.reset()

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    def reset(self) -> None:
        self.total, self.count = 0.0, 0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class HashSparseSelfAttention(CausalSelfAttention):
    """``CausalSelfAttention`` (same parameters) whose attention is hash-bucketed block-sparse:
    token i sees token j <= i of its own bucket (``lightning_dynmo.sparse.hash_layout``).

    The rotations are a buffer (they move and checkpoint with the layer), drawn from a
    generator seeded by the layer index, so weights drawn from the global RNG are the same as
    in a dense model. ``hash_redraw``: training forwards use rotations drawn from
    ``(layer seed, hash_step)``, ``hash_step`` being a buffer holding the optimizer step, which
    ``GPT`` sets at the start of every training batch (:func:`set_hash_step`). The draw is thus a
    function of (layer, step) alone -- not of the rank, the micro-batch or how many forwards ran
    -- so a pipeline equals one process, and a forward changes no state (activation
    checkpointing recomputes it exactly). Attention-probability dropout is not applied (the
    residual dropout is). ``load_factor()`` (the ReportsLoad protocol) is the mean block density
    (active / causal block pairs) of the training forwards since ``reset_load()``.
    """

    def __init__(self, config: GPTConfig, layer_index: int = 0):
        super().__init__(config)
        self.block = int(config.attention_block)
        self.nb_hash = config.layer_nb_hash(layer_index)
        self.redraw = bool(config.hash_redraw)
        self.center = config.hash_center
        self.backend = config.attention_backend
        self._seed = 0x5EED0000 + 7919 * int(layer_index)
        head_dim = config.n_embd // config.n_head
        with torch.device("cpu"):  # drawn on the CPU whatever the ambient device
            rotations = draw_rotations(config.n_head, head_dim, self.nb_hash, torch.Generator().manual_seed(self._seed))
        # the ambient device: meta under a meta-device context (then reset_buffers() fills it)
        self.register_buffer("rotations", rotations.to(torch.empty(0).device))
        self.register_buffer("hash_step", torch.zeros((), dtype=torch.long))
        self.last_density: float | None = None
        self._drawn: tuple | None = None  # ((step, device, dtype), rotations) of hash_redraw
        # mean density of the training forwards: one window the strategy resets every step
        # (ReportsLoad), one a monitoring callback resets (SparseAttentionMonitor)
        self.load_window, self.monitor_window = RunningMean(), RunningMean()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Rotations from the layer's seed and ``hash_step`` 0, in place (meta-device init)."""
        with torch.device("cpu"):
            rotations = draw_rotations(*self.rotations.shape[:2], self.nb_hash, torch.Generator().manual_seed(self._seed))
        self.rotations.copy_(rotations)
        self.hash_step.zero_()

    def current_rotations(self) -> torch.Tensor:
        """The rotations a forward uses: the fixed buffer, or with ``hash_redraw`` in training
        those of step ``hash_step`` (drawn once per step and cached)."""
        if not (self.redraw and self.training):
            return self.rotations
        key = (int(self.hash_step), self.rotations.device, self.rotations.dtype)
        if self._drawn is None or self._drawn[0] != key:
            gen = torch.Generator().manual_seed(self._seed + 1_000_003 * key[0])
            self._drawn = (key, draw_rotations(*self.rotations.shape[:2], self.nb_hash, gen, key[1], key[2]))
        return self._drawn[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y, plan = hash_sparse_attention(q, k, v, self.current_rotations(), self.nb_hash, self.block,
                                        backend=self.backend, center=self.center)
        self.last_density = plan.density
        if self.training and torch.is_grad_enabled():
            self.load_window.add(plan.density)
            self.monitor_window.add(plan.density)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))

    def load_factor(self) -> float | None:
        return self.load_window.mean

    def reset_load(self) -> None:
        self.load_window.reset()


class Block(nn.Module):
    """Pre-LN transformer block ``[B,T,C] -> [B,T,C]``."""

    def __init__(self, config: GPTConfig, mlp_ratio: float | None = None, attn: nn.Module | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config) if attn is None else attn
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, config.mlp_ratio if mlp_ratio is None else mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SparseAttentionBlock(Block):
    """``Block`` with :class:`HashSparseSelfAttention`; built by GPT for ``"hash_sparse"`` layers.

    A ``ReportsLoad`` pipeline layer: ``load_factor()`` is the block's work relative to the same
    block with dense causal attention, in multiply-accumulates per training forward since
    ``reset_load()``: ``(F + d A) / (F + A)`` with ``F`` the density-independent work (qkv, proj,
    MLP), ``A`` the attention's at density 1 and ``d`` the measured block density;
    ``attention_density()`` is ``d`` alone (mean active / causal block pairs).
    """

    def __init__(self, config: GPTConfig, mlp_ratio: float | None = None, layer_index: int = 0):
        super().__init__(config, mlp_ratio, attn=HashSparseSelfAttention(config, layer_index))
        self._last_macs: tuple[int, int] | None = None
        self.reset_load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.training and torch.is_grad_enabled():
            fixed, full = self._macs(*x.shape)
            self._last_macs = (fixed, full)
            self._fixed_macs += fixed
            self._full_attn_macs += full
            self._attn_macs += self.attn.last_density * full
        return y

    def _macs(self, b: int, t: int, c: int) -> tuple[int, int]:
        """(F, A) of one forward: the density-independent work and the attention's at density 1."""
        bs = self.attn.block
        n = -(-t // bs)
        hidden = self.mlp.fc.out_features
        # QK^T and PV over every causal block pair at density 1, all heads.
        return b * t * (4 * c * c + 2 * c * hidden), b * n * (n + 1) // 2 * bs * bs * 2 * c

    def relative_work(self, density: float) -> float | None:
        """``(F + d A) / (F + A)`` at block density ``d`` for the shape of the last training
        forward (``None`` before one)."""
        if self._last_macs is None:
            return None
        fixed, full = self._last_macs
        return (fixed + density * full) / (fixed + full)

    def attention_density(self) -> float | None:
        return self.attn.load_factor()

    def density_stats(self) -> float | None:
        """Mean block density of the training forwards since :meth:`reset_density_stats`, a
        window of its own for monitoring callbacks (the strategy resets the load window)."""
        return self.attn.monitor_window.mean

    def reset_density_stats(self) -> None:
        self.attn.monitor_window.reset()

    def load_factor(self) -> float | None:
        if self._full_attn_macs == 0:
            return None
        return (self._fixed_macs + self._attn_macs) / (self._fixed_macs + self._full_attn_macs)

    def reset_load(self) -> None:
        self._fixed_macs = self._attn_macs = self._full_attn_macs = 0
        self.attn.reset_load()


@torch.no_grad()
def set_hash_step(module: nn.Module, step: int) -> None:
    """Make every :class:`HashSparseSelfAttention` in ``module`` draw the rotations of optimizer
    step ``step`` (``hash_redraw``). ``GPT`` calls it at the start of each training batch on
    whatever layers the rank holds; a hand-written training loop calls it once per step."""
    for m in module.modules():
        if isinstance(m, HashSparseSelfAttention):
            m.hash_step.fill_(int(step))


class FinalNorm(nn.Module):
    """Final LayerNorm as its own layer so the head stays a bare Linear."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


class Head(nn.Module):
    """LM head ``[B,T,C] -> logits [B,T,V]``; untied from the embedding (stages may differ)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)


class GPT(CausalLMModule):
    """Byte/token-level GPT exposing the dynmo pipeline protocol (see module docstring); training,
    evaluation and optimizer hooks from :class:`CausalLMModule`."""

    def __init__(
        self,
        config: GPTConfig | dict | str | None = None,
        lr: float = 6e-4,
        min_lr: float = 6e-5,
        warmup_steps: int = 10,
        max_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        seed: int | None = None,
    ):
        super().__init__()
        cfg = GPTConfig.from_any(config)
        config = cfg.to_dict()  # noqa: F841  -- save_hyperparameters reads this local (a dict)
        betas = tuple(float(b) for b in betas)
        self.save_hyperparameters()
        self.config = cfg

        # Each layer is initialised from its own generator seeded by (seed, layer index), so a rank
        # that builds only its own layers gets the single-process values (init_pipeline_layer).
        # seed=None: the base seed is drawn from the global RNG (seed_everything fixes it).
        self._init_seed = int(seed) if seed is not None else int(torch.randint(0, 2**62, (), device="cpu"))
        # fork_rng: layer constructors (e.g. nn.Linear's default init) must not move the caller's RNG
        with torch.random.fork_rng(devices=[]):
            layers: list[nn.Module] = [Embedding(cfg)]
            layers += [
                SparseAttentionBlock(cfg, cfg.block_mlp_ratio(i), layer_index=i)
                if cfg.layer_attention(i) == "hash_sparse" else Block(cfg, cfg.block_mlp_ratio(i))
                for i in range(cfg.n_layer)
            ]
            layers += [FinalNorm(cfg), Head(cfg)]
            self.layers = nn.ModuleList(layers)
        self._init_weights()

        self._init_eval_metric()

    # ------------------------------------------------------------------ init
    def _init_weights(self) -> None:
        """Initialise every layer (:meth:`init_pipeline_layer`). Layers built on the meta device
        (``trainer.init_module(empty_init=True)`` under DynMoStrategy) are left to the strategy,
        which initialises only those the rank owns, with the same values."""
        for i, layer in enumerate(self.layers):
            if not any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
                self.init_pipeline_layer(i, layer)

    @torch.no_grad()
    def init_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        """Initialise pipeline layer ``index`` in place from a generator seeded by ``(seed, index)``
        alone (GPT-2 / nanoGPT scheme): Linear and Embedding weights N(0, 0.02), the residual
        projections (``attn.proj``, ``mlp.proj``) N(0, 0.02 / sqrt(2 n_layer)), biases 0,
        LayerNorm (1, 0), hash-attention buffers from their own seed. Values are drawn in fp32 on
        the CPU and copied, so they do not depend on the layer's dtype or device: a single-process
        model, a model converted to bf16 and a rank materialising only this layer all agree."""
        gen = torch.Generator().manual_seed(layer_seed(self._init_seed, index))
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        residual = {id(m.proj) for m in layer.modules() if isinstance(m, (CausalSelfAttention, MLP))}

        def normal_(t: torch.Tensor, std: float) -> None:
            if t.dtype == torch.float32 and t.device.type == "cpu":
                t.normal_(0.0, std, generator=gen)  # the same draw, without a temporary
            else:
                t.copy_(torch.empty(t.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen))

        for m in layer.modules():
            if isinstance(m, nn.Linear):
                normal_(m.weight, resid_std if id(m) in residual else 0.02)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                normal_(m.weight, 0.02)
            elif isinstance(m, nn.LayerNorm):
                if m.weight is not None:
                    m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, HashSparseSelfAttention):
                m.reset_buffers()

    # ------------------------------------------------------------------ protocol
    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.layers:
            x = layer(x)
        return x

    # ------------------------------------------------------------------ lightning hooks
    def on_train_batch_start(self, batch, batch_idx) -> None:
        # before the strategy's hook (which may migrate layers): every rank sets its own layers
        set_hash_step(self, self.global_step)

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Autoregressive sampling; single-process only (needs every layer present).

        ``idx``: int64 ``[B, T]`` prompt; the context is cropped to ``block_size``.
        ``temperature <= 0`` means greedy decoding. Returns ``[B, T + max_new_tokens]``.
        """
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                ctx = idx[:, -self.config.block_size :]
                logits = self(ctx)[:, -1, :].float()
                if temperature <= 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        k = min(int(top_k), logits.size(-1))
                        kth = torch.topk(logits, k).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx
