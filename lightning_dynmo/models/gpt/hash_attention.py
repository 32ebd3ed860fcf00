"""GPT blocks with hash-based dynamic sparse attention (``GPTConfig(attention="hash_sparse")``):
the attention, its block-density counters, and the block that reports its load to the strategy
(the ReportsLoad protocol), apart from the dense layers in :mod:`~lightning_dynmo.models.gpt.layers`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_dynmo.sparse.hash_layout import draw_rotations, hash_sparse_attention

from .granularity import AttentionHalf, MLPHalf
from .layers import Block, CausalSelfAttention

if TYPE_CHECKING:
    from .config import GPTConfig

__all__ = ["HashSparseSelfAttention", "SparseAttentionBlock", "SparseAttentionHalf", "SparseAttentionLoad",
           "set_hash_step"]


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
            rotations = draw_rotations(*self.rotations.shape[:2], self.nb_hash,
                                       torch.Generator().manual_seed(self._seed))
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


class SparseAttentionLoad:
    """The load accounting of a pipeline layer holding a :class:`HashSparseSelfAttention` (``attn``):
    a ``ReportsLoad`` whose ``load_factor()`` is the layer's work relative to the same layer with
    dense causal attention, in multiply-accumulates per training forward since ``reset_load()``:
    ``(F + d A) / (F + A)`` with ``F`` the density-independent work (:meth:`_fixed_macs`), ``A`` the
    attention's at density 1 and ``d`` the measured block density; ``attention_density()`` is ``d``
    alone (mean active / causal block pairs). Mixed in before the layer's class."""

    def _fixed_macs(self, c: int) -> int:
        """Density-independent multiply-accumulates per token (the layer's projections)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.training and torch.is_grad_enabled():
            fixed, full = self._macs(*x.shape)
            self._last_macs = (fixed, full)
            self._fixed_macs_sum += fixed
            self._full_attn_macs += full
            self._attn_macs += self.attn.last_density * full
        return y

    def _macs(self, b: int, t: int, c: int) -> tuple[int, int]:
        """(F, A) of one forward: the density-independent work and the attention's at density 1."""
        bs = self.attn.block
        n = -(-t // bs)
        # QK^T and PV over every causal block pair at density 1, all heads.
        return b * t * self._fixed_macs(c), b * n * (n + 1) // 2 * bs * bs * 2 * c

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
        return (self._fixed_macs_sum + self._attn_macs) / (self._fixed_macs_sum + self._full_attn_macs)

    def reset_load(self) -> None:
        self._fixed_macs_sum = self._attn_macs = self._full_attn_macs = 0
        self.attn.reset_load()


class SparseAttentionBlock(SparseAttentionLoad, Block):
    """``Block`` with :class:`HashSparseSelfAttention`; built by GPT for ``"hash_sparse"`` layers.
    A ``ReportsLoad`` pipeline layer (:class:`SparseAttentionLoad`; ``F``: qkv, proj and the MLP).
    At sublayer granularity its attention half carries the load accounting."""

    def __init__(self, config: GPTConfig, mlp_ratio: float | None = None, layer_index: int = 0):
        super().__init__(config, mlp_ratio, attn=HashSparseSelfAttention(config, layer_index))
        self._last_macs: tuple[int, int] | None = None
        self.reset_load()

    def _fixed_macs(self, c: int) -> int:
        return 4 * c * c + 2 * c * self.mlp.fc.out_features

    def split_sublayers(self) -> tuple[nn.Module, nn.Module]:
        return SparseAttentionHalf(self), MLPHalf(self)


class SparseAttentionHalf(SparseAttentionLoad, AttentionHalf):
    """The attention half of a :class:`SparseAttentionBlock` (sublayer granularity): its density
    counters and load (``F``: the qkv and output projections only)."""

    def __init__(self, block: SparseAttentionBlock):
        super().__init__(block)
        self._last_macs: tuple[int, int] | None = None
        self.reset_load()

    def _fixed_macs(self, c: int) -> int:
        return 4 * c * c


@torch.no_grad()
def set_hash_step(module: nn.Module, step: int) -> None:
    """Make every :class:`HashSparseSelfAttention` in ``module`` draw the rotations of optimizer
    step ``step`` (``hash_redraw``). ``GPT`` calls it at the start of each training batch on
    whatever layers the rank holds; a hand-written training loop calls it once per step."""
    for m in module.modules():
        if isinstance(m, HashSparseSelfAttention):
            m.hash_step.fill_(int(step))
