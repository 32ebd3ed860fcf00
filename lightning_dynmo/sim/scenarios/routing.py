"""Cases whose routing changes every iteration: mixture of experts, mixture of depths and
hash-bucketed sparse attention (the paper invokes DynMo every iteration for them). Routing
shares are softmaxes of seeded AR(1) logits (parameters and sources in the package docstring)."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from functools import lru_cache

from .profile import Profile, load_profile
from .snapshot import Block, Snapshot, dense_block, gpt_snapshot


def _ar1(rng: random.Random, std: float, persistence: float, steps: int) -> list[float]:
    """Zero-mean AR(1): stationary std ``std``, step-to-step correlation ``persistence``."""
    x, out = std * rng.gauss(0.0, 1.0), []
    for _ in range(steps):
        out.append(x)
        x = persistence * x + std * math.sqrt(1 - persistence**2) * rng.gauss(0.0, 1.0)
    return out


def _softmax(xs: Sequence[float]) -> list[float]:
    m = max(xs)
    w = [math.exp(x - m) for x in xs]
    s = sum(w)
    return [x / s for x in w]


@lru_cache(maxsize=16)
def logit_std_for_spread(spread: float, experts: int = 8, draws: int = 4000) -> float:
    """The logit std whose softmax shares have E[(max - min) / mean] = ``spread`` (bisection on
    a fixed-seed Monte Carlo): turns the paper's "40 % between busiest and least busy expert"
    into a routing model."""
    rng = random.Random(12345)
    zs = [[rng.gauss(0.0, 1.0) for _ in range(experts)] for _ in range(draws)]

    def stat(sd):
        acc = 0.0
        for z in zs:
            p = _softmax([sd * x for x in z])
            acc += (max(p) - min(p)) * experts
        return acc / draws

    lo, hi = 0.0, 5.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stat(mid) < spread else (lo, mid)
    return (lo + hi) / 2


def moe(layers: int, profile: Profile | None = None, snapshots: int = 24, every: int = 1, experts: int = 8,
        top_k: int = 2, expert_parallel: int = 8, capacity_factor: float | None = None, max_spread: float = 0.4,
        persistence: float = 0.9, seed: int = 0, **layout) -> list[Snapshot]:
    """Mixture of experts with expert parallelism; one snapshot per iteration (the routing
    changes every step). Block ``i`` is MoE when ``(i + 1) % every == 0``; the experts are its
    MLP half (the attention half is unchanged)."""
    profile = profile or load_profile()
    if experts % expert_parallel:
        raise ValueError(f"experts={experts} must be a multiple of expert_parallel={expert_parallel}")
    rng = random.Random(seed)
    per_rank = experts // expert_parallel
    sd_max = logit_std_for_spread(max_spread, experts)
    moe_blocks = [i for i in range(layers) if (i + 1) % every == 0]
    logits = {i: [_ar1(rng, sd_max * rng.uniform(0.25, 1.0), persistence, snapshots) for _ in range(experts)]
              for i in moe_blocks}
    T = profile.tokens
    full, dense_mlp = profile.block(1.0), profile.mlp(T)
    group_tokens = top_k * T * expert_parallel  # token-expert assignments of one micro-batch over the EP group
    cap = None if capacity_factor is None else capacity_factor * group_tokens / experts
    extra = (per_rank - 1) * profile.mlp_params()  # one rank's share of the experts beyond one
    params = [profile.block_params() + (extra if i in logits else 0) for i in range(layers)]
    mlp_params = [profile.mlp_half_params() + (extra if i in logits else 0) for i in range(layers)]
    dense = dense_block(profile)
    out = []
    for t in range(snapshots):
        blocks = []
        for i in range(layers):
            if i not in logits:
                blocks.append(dense)
                continue
            share = _softmax([e[t] for e in logits[i]])
            load = [group_tokens * s if cap is None else min(group_tokens * s, cap) for s in share]
            busiest = max(sum(load[r * per_rank:(r + 1) * per_rank]) for r in range(expert_parallel))
            expert = profile.mlp(busiest)
            blocks.append(Block(tuple(x - d + e for x, d, e in zip(full, dense_mlp, expert)), expert))
        out.append(gpt_snapshot(profile, blocks, iterations=1.0, block_params=params, mlp_params=mlp_params,
                                label=f"iteration {t}", **layout))
    return out


def mixture_of_depths(layers: int, profile: Profile | None = None, snapshots: int = 24, every: int = 2,
                      capacity: float = 0.125, noise: float = 0.05, persistence: float = 0.9,
                      seed: int = 0, **layout) -> list[Snapshot]:
    """Blocks ``every-1, 2 every-1, ...`` take a routed fraction of the tokens that drifts
    around ``capacity`` (clipped to [1/64, 1]), in both halves; one snapshot per iteration."""
    profile = profile or load_profile()
    rng = random.Random(seed)
    routed = {i: _ar1(rng, noise, persistence, snapshots) for i in range(layers) if (i + 1) % every == 0}
    out = []
    for t in range(snapshots):
        blocks = [dense_block(profile, min(1.0, max(1 / 64, capacity + routed[i][t])) if i in routed else 1.0)
                  for i in range(layers)]
        out.append(gpt_snapshot(profile, blocks, iterations=1.0, label=f"iteration {t}", **layout))
    return out


def sparse_attention(layers: int, profile: Profile | None = None, snapshots: int = 24, buckets: int = 4,
                     max_logit_std: float = 1.5, persistence: float = 0.9, seed: int = 0,
                     **layout) -> list[Snapshot]:
    """Hash-bucketed causal attention: layer l computes sum_b p_b^2 of its score blocks, p_b the
    share of tokens in bucket b (its attention half only); one snapshot per iteration."""
    profile = profile or load_profile()
    rng = random.Random(seed)
    logits = [[_ar1(rng, rng.uniform(0.0, max_logit_std), persistence, snapshots) for _ in range(buckets)]
              for _ in range(layers)]
    full, attn, mlp = profile.block(1.0), profile.attention(1.0), profile.mlp(profile.tokens)
    out = []
    for t in range(snapshots):
        blocks = []
        for lg in logits:
            d = sum(p * p for p in _softmax([b[t] for b in lg]))
            blocks.append(Block(tuple(x - a * (1 - d) for x, a in zip(full, attn)), mlp))
        out.append(gpt_snapshot(profile, blocks, iterations=1.0, label=f"iteration {t}", **layout))
    return out
