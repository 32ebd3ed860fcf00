"""Cases whose costs change slowly over training: the dense reference, progressive freezing,
early exit and gradual pruning (parameters and sources in the package docstring)."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace

from .profile import Profile, load_profile
from .snapshot import Block, Snapshot, dense_block, gpt_snapshot


def dense(layers: int, profile: Profile | None = None, total_iterations: float = 10_000, **layout) -> list[Snapshot]:
    """The same GPT without any dynamism (the reference the paper's early-exit and sparse
    attention speedups are measured against). ``layout``: ``granularity`` and ``head_chunks`` of
    :func:`gpt_snapshot`, as for every scenario."""
    profile = profile or load_profile()
    return [gpt_snapshot(profile, [dense_block(profile)] * layers, iterations=total_iterations, label="dense",
                         **layout)]


def _spans(total: float, snapshots: int) -> list[float]:
    return [total / snapshots] * snapshots


def freezing(layers: int, profile: Profile | None = None, snapshots: int = 12, final_frozen: float = 0.75,
             total_iterations: float = 10_000, **layout) -> list[Snapshot]:
    """Progressive front-to-back freezing (Egeria): the frozen prefix grows linearly from 0 to
    ``final_frozen`` of the blocks over the snapshots; the embedding freezes with the first block.
    Freezing a block freezes both its halves; the first trainable block skips only its input
    gradient, which its attention half computes (its MLP half still passes the gradient on)."""
    profile = profile or load_profile()
    full = dense_block(profile)
    out = []
    for t, span in enumerate(_spans(total_iterations, snapshots)):
        k = round(final_frozen * layers * t / max(1, snapshots - 1))
        blocks = []
        for i in range(layers):
            (f, b), (mf, mb) = full
            if i < k:
                b = mb = 0.0  # nothing below a frozen prefix needs gradients
            elif i == k and k > 0:
                b = profile.block_weights_only_backward(1.0)
            blocks.append(Block((f, b), (mf, mb)))
        out.append(gpt_snapshot(profile, blocks, iterations=span, frozen=[i < k for i in range(layers)],
                                embedding_frozen=k > 0, label=f"{k} frozen", **layout))
    return out


def early_exit(layers: int, profile: Profile | None = None, snapshots: int = 12,
               exits: Sequence[float] = (0.25, 0.5, 0.75), final_exit_rate: float = 0.5,
               total_iterations: float = 10_000, **layout) -> list[Snapshot]:
    """Exit points before blocks ``round(q L)``; at each, a share of the still-active tokens
    leaves that grows linearly from 0 to ``final_exit_rate`` as the model becomes confident
    (both halves of a block see its token fraction)."""
    profile = profile or load_profile()
    points = [round(q * layers) for q in exits]
    out = []
    for t, span in enumerate(_spans(total_iterations, snapshots)):
        e = final_exit_rate * t / max(1, snapshots - 1)
        frac = [(1 - e) ** sum(x <= i for x in points) for i in range(layers)]
        out.append(gpt_snapshot(profile, [dense_block(profile, f) for f in frac], iterations=span,
                                label=f"exit rate {e:.2f}", **layout))
    return out


def zhu_gupta(step: float, final: float = 0.9, initial: float = 0.0, start: float = 3000, every: float = 1000,
              n: int = 4) -> float:
    """Sparsity at ``step`` of Zhu & Gupta's cubic schedule, pruning at start + k * every."""
    if step < start:
        return initial
    k = min(n, math.floor((step - start) / every))
    return final + (initial - final) * (1 - k / n) ** 3


def pruning(layers: int, profile: Profile | None = None, final_sparsity: float = 0.9, start: float = 3000,
            every: float = 1000, n: int = 4, spread: float = 0.35, break_even_density: float = 0.25,
            total_iterations: float = 10_000, seed: int = 0, **layout) -> list[Snapshot]:
    """Global magnitude pruning of the blocks on Zhu-Gupta's schedule; one snapshot per sparsity
    level, weighted by the iterations it lasts. Block l's weights ~ N(0, s_l^2), log s_l ~
    N(0, spread^2); one global threshold keeps density erfc(tau / (s_l sqrt 2)) of block l, in
    both halves (the attention scores stay dense, so only the attention half keeps that part)."""
    profile = profile or load_profile()
    rng = random.Random(seed)
    sigma = [math.exp(spread * rng.gauss(0.0, 1.0)) for _ in range(layers)]
    changes = [0.0] + [start + k * every for k in range(n + 1) if start + k * every < total_iterations]
    changes = sorted(set(changes)) + [total_iterations]
    attn = profile.attention(1.0)
    full, mlp = profile.block(1.0), profile.mlp(profile.tokens)
    out = []
    for a, b in zip(changes, changes[1:]):
        sparsity = zhu_gupta(a, final_sparsity, 0.0, start, every, n)
        lo, hi = 0.0, 10.0 * max(sigma)
        for _ in range(100):  # bisection on the global threshold
            mid = (lo + hi) / 2
            if sum(math.erfc(mid / (s * math.sqrt(2))) for s in sigma) / layers > 1 - sparsity:
                lo = mid
            else:
                hi = mid
        density = [math.erfc(hi / (s * math.sqrt(2))) for s in sigma]
        blocks, params, mlp_params = [], [], []
        for d in density:
            scale = min(1.0, d / break_even_density)
            blocks.append(Block(tuple(at + (fb - at) * scale for fb, at in zip(full, attn)),
                                tuple(x * scale for x in mlp)))
            params.append(round(profile.block_params() * d))
            mlp_params.append(round(profile.mlp_half_params() * d))
        kw = dict(iterations=b - a, label=f"{sparsity:.0%} sparse", **layout)
        snap = gpt_snapshot(profile, blocks, block_params=params, mlp_params=mlp_params, **kw)
        dense_snap = gpt_snapshot(profile, blocks, **kw)
        out.append(replace(snap, reduced_params=dense_snap.costs.params))  # dense gradients are all-reduced
    return out
