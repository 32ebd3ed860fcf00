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
``"fine"``: each half cut once more, five layers per block: attention-in (LN 1 + QKV
projection), attention core, attention-out (output projection + residual), MLP-in (LN 2 + fc1 +
GELU), MLP-out (fc2 + residual); the head as with ``"sublayer"``. The profile measures halves,
not GEMMs, so a half is shared out (its pieces always add up to it): the attention half's
projections cost half of the MLP half at the same token count (4 h^2 against 8 h^2 multiply-adds
per token, the same GEMM shapes' efficiency), 3:1 between QKV and output projection, the core the
rest; the MLP half 0.55 : 0.45 between fc1 (with LN and GELU) and fc2 (A). A fine cut's
boundary carries what the next piece needs, in bf16: the residual stream plus the QKV output
(4 h per token), plus the attention output (2 h), plus the GELU output (5 h), so the cost model
and the simulator charge a wide cut its link time.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_dynmo.protocol.granularity import check_granularity
from lightning_dynmo.plan.cost_model import LayerCosts
from .profile import Profile

BYTES_PER_PARAM_STATE = 16.0  # bf16 weight + bf16 grad + fp32 master + 2 fp32 Adam moments
#: pipeline layers per transformer block
PIECES = {"block": 1, "sublayer": 2, "fine": 5}
#: Korthikanti et al. 2022 (flash attention, bf16): of a block's 34 s b h stored bytes, the
#: attention half keeps 13 (LN 2, QKV input 2, Q/K 4, V 2, projection input 2, mask 1), the MLP 21.
ATTENTION_STORED_SHARE = 13.0 / 34.0
#: fine granularity: of the attention half's 13, attention-in keeps 4 (LN, QKV input), the core 7
#: (Q/K, V, mask), attention-out 2 (projection input); of the MLP's 21, MLP-in 12 (LN, fc1 input,
#: GELU input), MLP-out 9 (fc2 input, mask)
FINE_STORED = (4.0 / 34.0, 7.0 / 34.0, 2.0 / 34.0, 12.0 / 34.0, 9.0 / 34.0)
#: fine granularity: bf16 values per token per hidden unit crossing each cut (residual stream +
#: what the next piece needs): after attention-in, core, attention-out, MLP-in, MLP-out
FINE_WIDTH = (4.0, 2.0, 1.0, 5.0, 1.0)
MLP_IN_SHARE = 0.55  # of the MLP half: LN 2 + fc1 + GELU (fc2 the rest)
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


def _fine_pieces(blk: Block, params: int, mlp_params: int, hidden: int) -> list[tuple[tuple[float, float], int, int]]:
    """A block's five fine pieces: ((forward, backward), parameters, index into FINE_*)."""
    att, mlp = blk.attention, blk.mlp
    proj = tuple(min(a, 0.5 * m) for a, m in zip(att, mlp))  # QKV + output projection
    core = tuple(a - p for a, p in zip(att, proj))
    times = [tuple(0.75 * p for p in proj), core, tuple(0.25 * p for p in proj),
             tuple(MLP_IN_SHARE * m for m in mlp), tuple((1 - MLP_IN_SHARE) * m for m in mlp)]
    h = hidden
    dense_att, dense_mlp = 4 * h * h + 6 * h, 8 * h * h + 7 * h
    shares = [(3 * h * h + 5 * h) / dense_att, 0.0, (h * h + h) / dense_att,
              (4 * h * h + 6 * h) / dense_mlp, (4 * h * h + h) / dense_mlp]
    att_p, m_p = params - mlp_params, mlp_params
    in_a, in_m = round(att_p * shares[0]), round(m_p * shares[3])
    counts = [in_a, 0, att_p - in_a, in_m, m_p - in_m]
    return [(t, c, i) for i, (t, c) in enumerate(zip(times, counts))]


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
    fine = granularity == "fine"
    bp = [profile.block_params()] * n if block_params is None else [int(p) for p in block_params]
    mp = [profile.mlp_half_params()] * n if mlp_params is None else [int(p) for p in mlp_params]
    frozen = [False] * n if frozen is None else list(frozen)
    emb_p, norm_p, head_p = (int(profile.params.get(key, 0)) for key in ("embedding", "final_norm", "head"))
    carried = TARGET_BYTES_PER_TOKEN * profile.tokens if k > 1 else 0.0
    edge = profile.boundary_bytes + carried
    stored_block = profile.stored_block_bytes
    fwd, bwd, params, reduced, stored = ([profile.embedding[0]], [0.0 if embedding_frozen else profile.embedding[1]],
                                         [emb_p], [0 if embedding_frozen else emb_p], [profile.boundary_bytes])
    act: list[float] = []  # bytes out of each layer but the last k (filled as the layers are)
    for blk, p, m, fz in zip(blocks, bp, mp, frozen):
        if fine:
            pieces = [(t, pp, FINE_STORED[i], edge + (FINE_WIDTH[i] - 1) * profile.boundary_bytes)
                      for t, pp, i in _fine_pieces(blk, p, m, profile.hidden)]
        elif sub:
            pieces = [(blk.attention, p - m, ATTENTION_STORED_SHARE, edge),
                      (blk.mlp, m, 1 - ATTENTION_STORED_SHARE, edge)]
        else:
            pieces = [(blk.total, p, 1.0, edge)]
        for (f, b), pp, share, out in pieces:
            fwd.append(f)
            bwd.append(b)
            params.append(pp)
            reduced.append(0 if fz else pp)
            stored.append(share * stored_block)
            act.append(out)
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
    act = [edge] + act + [edge] + [chunk_edge] * (k - 1) + [edge]  # embedding, blocks, norm, head chunks
    costs = LayerCosts(fwd, bwd, params, [BYTES_PER_PARAM_STATE * x for x in params], act)
    return Snapshot(costs, float(iterations), tuple(stored), None if reduced == params else tuple(reduced), label,
                    (1, PIECES[granularity], 1 + k))
