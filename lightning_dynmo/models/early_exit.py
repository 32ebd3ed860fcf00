"""Early exit for the pipeline GPT: blocks compute only on still-active tokens.

Activation layout
-----------------
Stages pass a pair ``(x [B, T, C], flag [B, T])`` (the pipeline's tuple activations):
``flag == 1.0`` for active tokens, ``0.0`` for exited ones, in ``x``'s dtype (it never carries a
gradient). :class:`ExitEmbedding` starts every token active, every :class:`ExitBlock` reads and
updates the flag, :class:`ExitFinalNorm` drops it before the LayerNorm, and the head is the plain
GPT head. (Before tuple activations the flag rode in an extra channel of the hidden state, which
cost a concatenation per block and a sliced copy before every matmul.)

Cost follows the active tokens
------------------------------
A block with some exited tokens packs each row's active tokens (order kept) into ``[B, A, C]``,
``A = max_b(active tokens of row b)``, runs attention (causal among the packed tokens, padding
masked) and the MLP on the packed tensor only, and scatters the results back. Exited tokens skip
the block (identity): their hidden state is carried unchanged to the head. When every token is
active the block runs the plain ``Block.forward`` (bitwise identical to GPT). Semantics: like
Mixture-of-Depths routing, an exited token is no longer a key/value for later tokens in deeper
blocks (CALM instead copies exited states into the KV cache, which would keep the K/V projection
cost of every token and defeat the saving).

Exit decision
-------------
Hidden-state saturation (Geva et al. / the "state propagation" oracle of CALM): at a configured
exit block, a still-active token exits when ``cos(h_in, h_out) > exit_threshold`` -- the block
barely changed its residual stream. We use saturation rather than a softmax-margin confidence of
the shared LM head because the head lives on the last pipeline rank, and a per-exit probe would
need the targets, which only the last stage has. Saturation needs no parameters and no targets.
``exit_threshold >= 1`` (or ``None``) is unreachable: the model then equals the plain GPT exactly.

Loss
----
``pipeline_loss`` is the plain mean token cross-entropy of the head's logits; an exited token's
logits are computed from its hidden state at its exit point (shared final norm + head). So every
token contributes exactly once, with weight 1/(B*T), at the depth where it left: the exit points
are trained through the shared head, and no deeper layer receives gradient from an exited token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._packing import pack, packed_attention, unpack
from .gpt import GPT, Block, Embedding, FinalNorm, GPTConfig
from .gpt.granularity import check_block_granularity

__all__ = ["EarlyExitGPT", "ExitEmbedding", "ExitBlock", "ExitFinalNorm", "active_mask_of"]


def active_mask_of(flag: Tensor) -> Tensor:
    """The bool ``[B, T]`` active-token mask of an exit flag (the pair's second tensor)."""
    return flag > 0.5


class ExitEmbedding(Embedding):
    """``idx [B,T] -> (x [B,T,C], flag [B,T])``: the GPT embedding, every token active."""

    def forward(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        x = super().forward(idx)
        return x, x.new_ones(x.shape[:-1])


class ExitFinalNorm(FinalNorm):
    """Drops the exit flag, then the final LayerNorm: ``(x, flag) -> [B,T,C]``."""

    def forward(self, x: Tensor, flag: Tensor) -> Tensor:
        return self.ln(x)


class ExitBlock(Block):
    """A GPT block over ``(x, flag)`` that computes only on active tokens and may exit some.

    Attributes (plain Python, they travel with the layer when it migrates):
        is_exit_point: whether tokens may exit after this block.
        exit_threshold: saturation threshold (``None`` / ``>= 1``: nobody exits).
        tokens_seen / tokens_active / tokens_computed: counters since the last ``reset_counters``
        (tokens entering, active tokens entering, token rows actually computed incl. padding).
        tokens_exited: tokens that exited at this block.

    It reports its load to the strategy (:class:`~lightning_dynmo.protocol.ReportsLoad`): token
    rows computed (padding included) per token entering, over the training forwards since
    :meth:`reset_load` (a window of its own, apart from the callback's counters).
    """

    def __init__(self, config: GPTConfig, mlp_ratio: float | None = None, is_exit_point: bool = False):
        super().__init__(config, mlp_ratio)
        self.n_head = config.n_head
        self.is_exit_point = bool(is_exit_point)
        self.exit_threshold: float | None = None
        self.reset_counters()
        self.reset_load()

    def reset_counters(self) -> None:
        self.tokens_seen = 0
        self.tokens_active = 0
        self.tokens_computed = 0
        self.tokens_exited = 0

    def reset_load(self) -> None:
        self._load_seen = 0
        self._load_computed = 0

    def load_factor(self) -> float | None:
        return self._load_computed / self._load_seen if self._load_seen else None

    @property
    def active_fraction(self) -> float:
        return self.tokens_active / self.tokens_seen if self.tokens_seen else math.nan

    def _packed(self, xp: Tensor, valid: Tensor) -> Tensor:
        """The block on packed tokens ``[B, A, C]``; ``valid [B, A]`` marks real (not padding) rows."""
        xp = xp + packed_attention(self.attn, self.ln_1(xp), valid, self.training)
        return xp + self.mlp(self.ln_2(xp))

    def forward(self, x: Tensor, flag: Tensor) -> tuple[Tensor, Tensor]:
        active = active_mask_of(flag)
        b, t = active.shape
        per_row = active.sum(dim=1)
        n_active = int(per_row.sum())
        self.tokens_seen += b * t
        self.tokens_active += n_active
        if n_active == b * t:
            y = Block.forward(self, x)  # the plain block: bitwise equal to GPT
            self.tokens_computed += b * t
        elif n_active == 0:
            y = x
        else:
            a = int(per_row.max())
            xp, packing = pack(x, active, per_row, a)
            y = unpack(x, xp, self._packed(xp, packing.valid), packing)
            self.tokens_computed += b * a
        if self.training and torch.is_grad_enabled():  # not evaluation, not the shape probe
            self._load_seen += b * t
            self._load_computed += b * t if n_active == b * t else (b * int(per_row.max()) if n_active else 0)
        thr = self.exit_threshold
        if self.is_exit_point and thr is not None and thr < 1.0 and n_active:
            with torch.no_grad():
                sat = F.cosine_similarity(y.detach().float(), x.detach().float(), dim=-1)
                leave = active & (sat > thr)
                self.tokens_exited += int(leave.sum())
                flag = (active & ~leave).to(flag.dtype)
        return y, flag.detach()


class EarlyExitGPT(GPT):
    """GPT whose blocks skip exited tokens (see the module docstring).

    Same parameters (names, shapes and, for the same ``seed``, values) as ``GPT`` with the same
    config, so ``EarlyExitGPT(...).load_state_dict(gpt.state_dict())`` works both ways.

    Args:
        exit_layers: block numbers (0-based, among the ``n_layer`` blocks) after which tokens may
            exit; default every block but the last.
        exit_threshold: initial saturation threshold (``None`` = nobody exits); the
            :class:`~lightning_dynmo.callbacks.EarlyExit` callback changes it while training.
        other args: as :class:`~lightning_dynmo.models.GPT`.
    """

    _head_chunks_supported = False  # its exit norm wraps the one head layer

    def __init__(self, config=None, exit_layers: list[int] | tuple[int, ...] | None = None,
                 exit_threshold: float | None = None, **kwargs):
        check_block_granularity(
            GPTConfig.from_any(config), "EarlyExitGPT",
            "an exit block computes attention and MLP on the same packed active tokens and decides the exit from "
            "its input and output hidden states, which a cut between its halves would separate")
        super().__init__(config, **kwargs)
        cfg = self.config
        exits = set(range(cfg.n_layer - 1) if exit_layers is None else (int(i) for i in exit_layers))
        bad = [i for i in exits if not 0 <= i < cfg.n_layer]
        if bad:
            raise ValueError(f"exit_layers {sorted(bad)} are not block numbers in [0, {cfg.n_layer})")
        self.exit_layers = tuple(sorted(exits))
        with torch.random.fork_rng(devices=[]):  # module construction must not move the caller's RNG
            new = [ExitEmbedding(cfg)]
            new += [ExitBlock(cfg, cfg.block_mlp_ratio(i), is_exit_point=i in exits) for i in range(cfg.n_layer)]
            new += [ExitFinalNorm(cfg), self.layers[-1]]
        for i, layer in enumerate(new[:-1]):
            layer.load_state_dict(self.layers[i].state_dict())
            self.layers[i] = layer
        self.set_exit_threshold(exit_threshold)

    def exit_blocks(self) -> list[tuple[int, ExitBlock]]:
        """``(global layer index, block)`` of the local exit blocks (remote layers skipped)."""
        return [(i, l) for i, l in enumerate(self.layers) if isinstance(l, ExitBlock)]

    def set_exit_threshold(self, threshold: float | None) -> None:
        for _, block in self.exit_blocks():
            block.exit_threshold = None if threshold is None else float(threshold)
