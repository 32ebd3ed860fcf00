"""Cases whose costs change slowly over training: the dense reference, progressive freezing,
early exit and gradual pruning (parameters and sources in the package docstring)."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace

from .profile import Profile, load_profile
from .snapshot import Snapshot, gpt_snapshot


def dense(layers: int, profile: Profile | None = None, total_iterations: float = 10_000) -> list[Snapshot]:
    """The same GPT without any dynamism (the reference the paper's early-exit and sparse
    attention speedups are measured against)."""
    profile = profile or load_profile()
    return [gpt_snapshot(profile, [profile.block(1.0)] * layers, iterations=total_iterations, label="dense")]


def _spans(total: float, snapshots: int) -> list[float]:
    return [total / snapshots] * snapshots


def freezing(layers: int, profile: Profile | None = None, snapshots: int = 12, final_frozen: float = 0.75,
             total_iterations: float = 10_000) -> list[Snapshot]:
    """Progressive front-to-back freezing (Egeria): the frozen prefix grows linearly from 0 to
    ``final_frozen`` of the blocks over the snapshots; the embedding freezes with the first block."""
    profile = profile or load_profile()
    out = []
    for t, span in enumerate(_spans(total_iterations, snapshots)):
        k = round(final_frozen * layers * t / max(1, snapshots - 1))
        blocks = []
        for i in range(layers):
            f, b = profile.block(1.0)
            if i < k:
                b = 0.0  # nothing below a frozen prefix needs gradients
            elif i == k and k > 0:
                b = profile.block_weights_only_backward(1.0)
            blocks.append((f, b))
        out.append(gpt_snapshot(profile, blocks, iterations=span, frozen=[i < k for i in range(layers)],
                                embedding_frozen=k > 0, label=f"{k} frozen"))
    return out


def early_exit(layers: int, profile: Profile | None = None, snapshots: int = 12,
               exits: Sequence[float] = (0.25, 0.5, 0.75), final_exit_rate: float = 0.5,
               total_iterations: float = 10_000) -> list[Snapshot]:
    """Exit points before blocks ``round(q L)``; at each, a share of the still-active tokens
    leaves that grows linearly from 0 to ``final_exit_rate`` as the model becomes confident."""
    profile = profile or load_profile()
    points = [round(q * layers) for q in exits]
    out = []
    for t, span in enumerate(_spans(total_iterations, snapshots)):
        e = final_exit_rate * t / max(1, snapshots - 1)
        frac = [(1 - e) ** sum(x <= i for x in points) for i in range(layers)]
        out.append(gpt_snapshot(profile, [profile.block(f) for f in frac], iterations=span,
                                label=f"exit rate {e:.2f}"))
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
            total_iterations: float = 10_000, seed: int = 0) -> list[Snapshot]:
    """Global magnitude pruning of the blocks on Zhu-Gupta's schedule; one snapshot per sparsity
    level, weighted by the iterations it lasts. Block l's weights ~ N(0, s_l^2), log s_l ~
    N(0, spread^2); one global threshold keeps density erfc(tau / (s_l sqrt 2)) of block l."""
    profile = profile or load_profile()
    rng = random.Random(seed)
    sigma = [math.exp(spread * rng.gauss(0.0, 1.0)) for _ in range(layers)]
    changes = [0.0] + [start + k * every for k in range(n + 1) if start + k * every < total_iterations]
    changes = sorted(set(changes)) + [total_iterations]
    attn = profile.attention(1.0)
    full = profile.block(1.0)
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
        blocks, params = [], []
        for d in density:
            scale = min(1.0, d / break_even_density)
            blocks.append(tuple(at + (fb - at) * scale for fb, at in zip(full, attn)))
            params.append(round(profile.block_params() * d))
        snap = gpt_snapshot(profile, blocks, iterations=b - a, block_params=params, label=f"{sparsity:.0%} sparse")
        dense_params = tuple(snap.costs.params[:1]) + (profile.block_params(),) * layers + tuple(snap.costs.params[-2:])
        out.append(replace(snap, reduced_params=dense_params))  # dense gradients are all-reduced
    return out
