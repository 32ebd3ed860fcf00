"""A GPT's per-layer costs at one point of training (:class:`Snapshot`), built from a profile:
``[embedding] + blocks + [final norm, head]`` as :class:`~lightning_dynmo.models.GPT` lays it out.

**Granularity.** ``"block"``: one pipeline layer per transformer block (the layout above).
``"sublayer"``: each block is two layers, its attention half (LN, attention, output projection,
residual) and its MLP half (LN, MLP, residual); with ``head_chunks=k`` the LM head + loss is k
layers over vocabulary slices (an online-softmax chain). A scenario describes each block as a
:class:`Block` (its whole cost and its MLP half's), so one dynamism model yields every
granularity and the pieces always add up to the block. What the finer cuts cost on the links is
counted: a chunk boundary carries the hidden state plus the running max, sum-exp and target
logit (fp32 per token), and with a chunked head the targets (int64 per token) ride along every
boundary to the head's chunks.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ...plan.cost_model import LayerCosts
from .profile import Profile

BYTES_PER_PARAM_STATE = 16.0  # bf16 weight + bf16 grad + fp32 master + 2 fp32 Adam moments
GRANULARITIES = ("block", "sublayer")
#: Korthikanti et al. 2022 (flash attention, bf16): of a block's 34 s b h stored bytes, the
#: attention half keeps 13 (LN 2, QKV input 2, Q/K 4, V 2, projection input 2, mask 1), the MLP 21.
ATTENTION_STORED_SHARE = 13.0 / 34.0
STATS_BYTES_PER_TOKEN = 12.0  # running max, sum-exp, target logit (fp32) between head chunks
TARGET_BYTES_PER_TOKEN = 8.0  # int64 targets carried to a chunked head


class Block(NamedTuple):
    """One transformer block's (forward, backward) seconds per micro-batch: the whole block and
    its MLP half; the attention half is the difference (so the halves always sum to the block)."""

    total: tuple[float, float]
    mlp: tuple[float, float]

    @property
    def attention(self) -> tuple[float, float]:
        return (max(0.0, self.total[0] - self.mlp[0]), max(0.0, self.total[1] - self.mlp[1]))


@dataclass(frozen=True)
class Snapshot:
    """The model's per-layer costs during ``iterations`` training iterations."""

    costs: LayerCosts  # time view: activation = bytes crossing a stage boundary
    iterations: float
    stored_activation: tuple[float, ...]  # bytes per layer kept for backward per micro-batch
    reduced_params: tuple[int, ...] | None = None  # data-parallel all-reduce (None: costs.params)
    label: str = ""
    layout: tuple[int, int, int] = (1, 1, 2)  # layers before the blocks, per block, after them

    def memory_view(self) -> LayerCosts:
        """Same layers with ``activation`` = stored bytes (for memory-capacity checks only)."""
        c = self.costs
        return LayerCosts(c.forward, c.backward, c.params, c.memory, self.stored_activation)


def dense_block(profile: Profile, fraction: float = 1.0) -> Block:
    """A block on ``fraction`` of the tokens (packed): both halves see the same tokens."""
    return Block(profile.block(fraction), profile.mlp(fraction * profile.tokens))


def check_granularity(granularity: str, head_chunks: int) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks must be an int >= 1, got {head_chunks!r}")


def _split(total: int, k: int) -> list[int]:
    q, r = divmod(total, k)
    return [q + 1] * r + [q] * (k - r)


def gpt_snapshot(profile: Profile, blocks: Sequence[Block], *, iterations: float = 1.0,
                 block_params: Sequence[int] | None = None, mlp_params: Sequence[int] | None = None,
                 frozen: Sequence[bool] | None = None, embedding_frozen: bool = False, label: str = "",
                 granularity: str = "block", head_chunks: int = 1) -> Snapshot:
    """``[embedding] + blocks + [final norm] + head chunks`` from per-block :class:`Block` costs.

    ``block_params``: what each block holds (default: the profile's dense block), ``mlp_params``
    its MLP half's share (default: the profile's MLP half); ``frozen``: blocks whose gradients are
    not all-reduced (their backward is already in ``blocks``)."""
    check_granularity(granularity, head_chunks)
    if not all(isinstance(b, Block) for b in blocks):
        raise TypeError("gpt_snapshot needs one Block(total=(fwd, bwd), mlp=(fwd, bwd)) per transformer block")
    n, sub, k = len(blocks), granularity == "sublayer", head_chunks
    bp = [profile.block_params()] * n if block_params is None else [int(p) for p in block_params]
    mp = [profile.mlp_half_params()] * n if mlp_params is None else [int(p) for p in mlp_params]
    frozen = [False] * n if frozen is None else list(frozen)
    emb_p, norm_p, head_p = (int(profile.params.get(key, 0)) for key in ("embedding", "final_norm", "head"))
    carried = TARGET_BYTES_PER_TOKEN * profile.tokens if k > 1 else 0.0
    edge = profile.boundary_bytes + carried
    stored_block = profile.stored_block_bytes
    fwd, bwd, params, reduced, stored = ([profile.embedding[0]], [0.0 if embedding_frozen else profile.embedding[1]],
                                         [emb_p], [0 if embedding_frozen else emb_p], [profile.boundary_bytes])
    for blk, p, m, fz in zip(blocks, bp, mp, frozen):
        pieces = ((blk.attention, p - m, ATTENTION_STORED_SHARE), (blk.mlp, m, 1 - ATTENTION_STORED_SHARE)) if sub \
            else ((blk.total, p, 1.0),)
        for (f, b), pp, share in pieces:
            fwd.append(f)
            bwd.append(b)
            params.append(pp)
            reduced.append(0 if fz else pp)
            stored.append(share * stored_block)
    fwd.append(profile.final_norm[0])
    bwd.append(profile.final_norm[1])
    params.append(norm_p)
    reduced.append(norm_p)
    stored.append(profile.boundary_bytes)
    for hp in _split(head_p, k):
        fwd.append(profile.head[0] / k)
        bwd.append(profile.head[1] / k)
        params.append(hp)
        reduced.append(hp)
        stored.append(profile.stored_head_bytes / k)
    chunk_edge = edge + (STATS_BYTES_PER_TOKEN * profile.tokens if k > 1 else 0.0)
    act = [edge] * (len(fwd) - k) + [chunk_edge] * (k - 1) + [edge]
    costs = LayerCosts(fwd, bwd, params, [BYTES_PER_PARAM_STATE * x for x in params], act)
    return Snapshot(costs, float(iterations), tuple(stored), None if reduced == params else tuple(reduced), label,
                    (1, 2 if sub else 1, 1 + k))
