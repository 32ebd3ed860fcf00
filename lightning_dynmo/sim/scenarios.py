"""Per-layer cost trajectories of the six dynamism cases at the DynMo paper's scale, and static vs
dynamic balancing of them in the simulator.

**What is measured and what is modelled.** Every layer cost starts from a *measured* profile of
the paper's GPT (appendix A: hidden 1024, 32 heads, sequence 2048, micro-batch 2; GPT-2
vocabulary padded to 50304): :class:`Profile` holds the forward/backward milliseconds of one
transformer block at token fractions 1/16 ... 1 (packed tokens), of its causal attention alone,
of its MLP at token counts (one MoE expert), of the embedding, the final norm and the LM head
with its fp32 cross-entropy. The bundled profile (``profiles/h100_gpt_h1024_s2048_mb2.json``)
was measured by ``benchmarks/block_profile.py`` on one NVIDIA H100 80GB (bf16, torch 2.11, CUDA
graphs, so kernel time without Python launch overhead). :meth:`Profile.from_flops` is the
FLOP-count fallback (no measurement). How each dynamism *changes* those costs over training is a
**model** with the parameters below; none is fitted to the paper's speedups or bubbles.

The model is the whole GPT: ``[embedding] + blocks + [final norm] + [head + loss]``, as this
package's :class:`~lightning_dynmo.models.GPT` lays it out (the head with its loss costs about
four blocks, which is why even a dense model is not balanced by equal layer counts).

Parameters and where they come from (P: the DynMo paper, ``seeds/001``; M: measured here; L:
other literature; A: our assumption, exposed as an argument):

=================  ==========================================================================
case               parameters
=================  ==========================================================================
all                block/attention/MLP/head costs (M, H100 profile); 16 bytes of state per
                   parameter (L: bf16 weight + grad, fp32 master + two Adam moments);
                   activation stored for backward ~34 s b h bytes per block (L: Korthikanti et
                   al. 2022 with flash attention); 10,000 iterations (P, appendix A)
freezing           frozen prefix grows front to back (P, F.4: Egeria) to ``final_frozen`` =
                   0.75 of the blocks (A); frozen layers run forward only, the first trainable
                   block computes weight gradients only (M), frozen layers skip the
                   data-parallel all-reduce
early_exit         exit points after 1/4, 1/2, 3/4 of the blocks (A); the share of tokens that
                   leave at each grows linearly to ``final_exit_rate`` = 0.5 (A); a block costs
                   its measured cost at its token fraction (packed tokens: attention ~ T^2, small
                   GEMMs less efficient) (M); every token still reaches the head
pruning            Zhu-Gupta cubic schedule to 90 % from iteration 3000, every 1000, 4 steps:
                   52 / 79 / 89 / 90 % (P, 4.1); global magnitude threshold over blocks whose
                   weight scales are log-normal, ``spread`` = 0.35 (A); sparse kernels cost
                   ``density / 0.25`` of dense below 25 % density (P, Fig. 6: Sputnik beats
                   cuBLAS from 75 % sparsity on H100); attention scores, embedding and head stay
                   dense (A); param balancers see non-zero counts
moe                Mixtral-style (P, F.2): every block MoE, 8 experts, top-2, dropless; expert
                   parallelism over 8 data-parallel ranks (P: 8-way data x 16-way pipeline), so
                   a layer runs at the pace of its busiest expert rank (max over EP ranks of the
                   measured MLP time at its token count); routing shares are a softmax of AR(1)
                   logits whose spread reaches the paper's "up to 40 % between busiest and least
                   busy expert" (P, 2) on the worst layers (A: spread ~ U(0.25, 1) x that),
                   step-to-step correlation 0.9 (A); the all-to-all itself is not modelled
mod                every other block routed, capacity 12.5 % (L: Raposo et al. 2024); the
                   realised fraction drifts (AR(1), std 0.05, correlation 0.9) because the paper
                   routes without future tokens (P, Fig. 1) (A: the numbers)
sparse_attention   hash-bucketed attention with 4 buckets (L: Pagliardini et al. 2023): a layer
                   computes the fraction sum_b p_b^2 of its causal score blocks, p_b its bucket
                   shares (softmax of AR(1) logits, per-layer std ~ U(0, 1.5), correlation 0.9:
                   A); attention costs that fraction of its measured dense time (M), the rest
                   of the block is unchanged
=================  ==========================================================================

Random draws are seeded; the same arguments give the same trajectory.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from ..plan.balancers import BalanceProblem, get_balancer
from ..plan.cost_model import LayerCosts
from ..plan.partition import Partition
from ..plan.repack import RepackRefused, plan_repack, rescale
from ..plan.schedules import choose_microbatches, get_schedule
from .simulate import DataParallel, Link, matching_cost_model, simulate

PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "h100_gpt_h1024_s2048_mb2"
BYTES_PER_PARAM_STATE = 16.0  # bf16 weight + bf16 grad + fp32 master + 2 fp32 Adam moments
STATIC = ("megatron", "uniform", "param")
DYNAMIC = ("partition_time", "partition_param", "diffusion_time", "diffusion_param")


# ------------------------------------------------------------------------------ the profile
def _isotonic(ys: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): timing noise must not make
    a layer cheaper with more tokens."""
    blocks: list[list[float]] = []  # [mean, weight]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks[-2], blocks.pop()
            blocks[-1] = [(m2 * w2 + m1 * w1) / (w2 + w1), w2 + w1]
    out: list[float] = []
    for m, w in blocks:
        out.extend([m] * int(w))
    return out


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear in ``x``; constant below the table, linear extrapolation above it."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


@dataclass(frozen=True)
class Profile:
    """Seconds per micro-batch of the GPT's layers (see the module docstring)."""

    name: str
    source: str  # device and how it was obtained
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    vocab: int
    fractions: tuple[float, ...]  # token fractions of the block rows, ascending
    block_fwd: tuple[float, ...]
    block_bwd: tuple[float, ...]
    block_bwd_weights: tuple[float, ...]  # backward without the input gradient
    attn_fwd: tuple[float, ...]  # causal attention alone, same fractions
    attn_bwd: tuple[float, ...]
    mlp_tokens: tuple[float, ...]  # LN + MLP alone at token counts, ascending
    mlp_fwd: tuple[float, ...]
    mlp_bwd: tuple[float, ...]
    embedding: tuple[float, float]
    final_norm: tuple[float, float]
    head: tuple[float, float]  # LM head + fp32 cross-entropy
    params: dict = field(default_factory=dict)  # block, embedding, final_norm, head

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch * self.seq

    @property
    def boundary_bytes(self) -> float:
        """The bf16 activation a stage sends per micro-batch (and its gradient back)."""
        return 2.0 * self.tokens * self.hidden

    @property
    def stored_block_bytes(self) -> float:
        """Activations a block keeps for backward per micro-batch: 34 s b h bytes (Korthikanti
        et al. 2022, bf16, flash attention so no s^2 term)."""
        return 34.0 * self.tokens * self.hidden

    @property
    def stored_head_bytes(self) -> float:
        """The head keeps bf16 logits and their fp32 copy for the loss."""
        return 6.0 * self.tokens * self.vocab

    @classmethod
    def load(cls, name_or_path: str | Path = DEFAULT_PROFILE) -> "Profile":
        """A bundled profile by name (``profiles/<name>.json``) or a JSON file from
        ``benchmarks/block_profile.py``."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            bundled = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise FileNotFoundError(f"no profile {name_or_path!r}; bundled: {bundled} (or pass a JSON path)")
        d = json.loads(path.read_text())
        ms = 1e-3
        b, a, m = d["block"], d["attention_core"], d["mlp"]

        def fit(xs, ys):
            order = sorted(range(len(xs)), key=lambda i: xs[i])
            return tuple(xs[i] for i in order), tuple(ms * y for y in _isotonic([ys[i] for i in order]))

        fr, bf = fit(b["fractions"], b["forward_ms"])
        _, bb = fit(b["fractions"], b["backward_ms"])
        _, bw = fit(b["fractions"], b["backward_weights_only_ms"])
        afr, af = fit(a["fractions"], a["forward_ms"])
        _, ab = fit(a["fractions"], a["backward_ms"])
        if afr != fr:
            raise ValueError(f"{path}: block and attention rows need the same fractions")
        mt, mf = fit(m["tokens"], m["forward_ms"])
        _, mb = fit(m["tokens"], m["backward_ms"])
        pair = lambda k: (ms * d[k]["forward_ms"], ms * d[k]["backward_ms"])  # noqa: E731
        return cls(
            name=path.stem, source=f"measured: {d.get('device')} ({d.get('dtype')}, torch {d.get('torch')}; "
            "benchmarks/block_profile.py)", hidden=d["hidden"], heads=d["heads"], seq=d["seq"],
            micro_batch=d["micro_batch"], vocab=d["vocab"], fractions=fr, block_fwd=bf, block_bwd=bb,
            block_bwd_weights=bw, attn_fwd=af, attn_bwd=ab, mlp_tokens=mt, mlp_fwd=mf, mlp_bwd=mb,
            embedding=pair("embedding"), final_norm=pair("final_norm"), head=pair("head_loss"),
            params=dict(d.get("params", {})),
        )

    @classmethod
    def from_flops(cls, hidden: int = 1024, heads: int = 32, seq: int = 2048, micro_batch: int = 2,
                   vocab: int = 50304, flops_per_second: float = 4e14) -> "Profile":
        """No measurement: forward FLOPs at one effective rate (default 40 % of an H100's dense
        bf16 peak), backward 2x forward (weights-only backward 1x). Block: QKV/output 8 b s h^2,
        MLP 16 b s h^2, causal attention 2 b s^2 h (half of the 4 b s^2 h square); all linear in
        the token count except attention (quadratic)."""
        t = micro_batch * seq
        fr = (0.0625, 0.125, 0.25, 0.5, 0.75, 1.0)

        def sec(flops):
            return flops / flops_per_second

        dense = [sec(24 * f * t * hidden**2) for f in fr]
        attn = [sec(2 * (f * seq) ** 2 * micro_batch * hidden) for f in fr]
        toks = (512.0, 4096.0, 32768.0)
        mlp = [sec(16 * n * hidden**2) for n in toks]
        return cls(
            name="flops", source=f"FLOP model at {flops_per_second:.3g} FLOP/s (not measured)", hidden=hidden,
            heads=heads, seq=seq, micro_batch=micro_batch, vocab=vocab, fractions=fr,
            block_fwd=tuple(d + a for d, a in zip(dense, attn)), block_bwd=tuple(2 * (d + a) for d, a in zip(dense, attn)),
            block_bwd_weights=tuple(d for d in dense), attn_fwd=tuple(attn), attn_bwd=tuple(2 * a for a in attn),
            mlp_tokens=toks, mlp_fwd=tuple(mlp), mlp_bwd=tuple(2 * x for x in mlp),
            embedding=(sec(t * hidden), sec(2 * t * hidden)), final_norm=(sec(5 * t * hidden), sec(10 * t * hidden)),
            head=(sec(2 * t * hidden * vocab), sec(4 * t * hidden * vocab)),
            params={"block": 12 * hidden**2 + 13 * hidden, "embedding": (vocab + seq) * hidden,
                    "final_norm": 2 * hidden, "head": vocab * hidden},
        )

    # seconds per micro-batch -------------------------------------------------------------
    def block(self, fraction: float = 1.0) -> tuple[float, float]:
        """(forward, backward) of a block that runs on ``fraction`` of the tokens (packed)."""
        return _interp(self.fractions, self.block_fwd, fraction), _interp(self.fractions, self.block_bwd, fraction)

    def block_weights_only_backward(self, fraction: float = 1.0) -> float:
        return _interp(self.fractions, self.block_bwd_weights, fraction)

    def attention(self, fraction: float = 1.0) -> tuple[float, float]:
        return _interp(self.fractions, self.attn_fwd, fraction), _interp(self.fractions, self.attn_bwd, fraction)

    def mlp(self, tokens: float) -> tuple[float, float]:
        """(forward, backward) of LN + MLP on ``tokens`` tokens (0 tokens: nothing runs)."""
        if tokens <= 0:
            return 0.0, 0.0
        return _interp(self.mlp_tokens, self.mlp_fwd, tokens), _interp(self.mlp_tokens, self.mlp_bwd, tokens)

    def block_params(self) -> int:
        return int(self.params.get("block", 12 * self.hidden**2 + 13 * self.hidden))

    def mlp_params(self) -> int:
        return 8 * self.hidden**2 + 5 * self.hidden


@lru_cache(maxsize=8)
def load_profile(name: str = DEFAULT_PROFILE) -> Profile:
    return Profile.from_flops() if name == "flops" else Profile.load(name)


# ------------------------------------------------------------------------------ trajectories
@dataclass(frozen=True)
class Snapshot:
    """The model's per-layer costs during ``iterations`` training iterations."""

    costs: LayerCosts  # time view: activation = bytes crossing a stage boundary
    iterations: float
    stored_activation: tuple[float, ...]  # bytes per layer kept for backward per micro-batch
    reduced_params: tuple[int, ...] | None = None  # data-parallel all-reduce (None: costs.params)
    label: str = ""

    def memory_view(self) -> LayerCosts:
        """Same layers with ``activation`` = stored bytes (for memory-capacity checks only)."""
        c = self.costs
        return LayerCosts(c.forward, c.backward, c.params, c.memory, self.stored_activation)


def gpt_snapshot(profile: Profile, blocks: Sequence[tuple[float, float]], *, iterations: float = 1.0,
                 block_params: Sequence[int] | None = None, frozen: Sequence[bool] | None = None,
                 embedding_frozen: bool = False, label: str = "") -> Snapshot:
    """``[embedding] + blocks + [final norm, head]`` from per-block (forward, backward) seconds.

    ``block_params``: what each block holds (default: the profile's dense block); ``frozen``:
    blocks whose gradients are not all-reduced (their backward is already in ``blocks``)."""
    n = len(blocks)
    bp = [profile.block_params()] * n if block_params is None else [int(p) for p in block_params]
    emb_p, norm_p, head_p = (int(profile.params.get(k, 0)) for k in ("embedding", "final_norm", "head"))
    fwd = [profile.embedding[0], *(f for f, _ in blocks), profile.final_norm[0], profile.head[0]]
    bwd = [0.0 if embedding_frozen else profile.embedding[1], *(b for _, b in blocks), profile.final_norm[1],
           profile.head[1]]
    params = [emb_p, *bp, norm_p, head_p]
    frozen = [False] * n if frozen is None else list(frozen)
    reduced = tuple([0 if embedding_frozen else emb_p, *(0 if fz else p for fz, p in zip(frozen, bp)), norm_p, head_p])
    edge = profile.boundary_bytes
    stored = (profile.boundary_bytes, *[profile.stored_block_bytes] * n, profile.boundary_bytes,
              profile.stored_head_bytes)
    costs = LayerCosts(fwd, bwd, params, [BYTES_PER_PARAM_STATE * p for p in params], [edge] * (n + 3))
    return Snapshot(costs, float(iterations), stored, None if reduced == tuple(params) else reduced, label)


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
        persistence: float = 0.9, seed: int = 0) -> list[Snapshot]:
    """Mixture of experts with expert parallelism; one snapshot per iteration (the routing
    changes every step). Block ``i`` is MoE when ``(i + 1) % every == 0``."""
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
    bp = profile.block_params() + (per_rank - 1) * profile.mlp_params()  # one rank's share of the experts
    params = [bp if i in logits else profile.block_params() for i in range(layers)]
    out = []
    for t in range(snapshots):
        blocks = []
        for i in range(layers):
            if i not in logits:
                blocks.append(full)
                continue
            share = _softmax([e[t] for e in logits[i]])
            load = [group_tokens * s if cap is None else min(group_tokens * s, cap) for s in share]
            busiest = max(sum(load[r * per_rank:(r + 1) * per_rank]) for r in range(expert_parallel))
            expert = profile.mlp(busiest)
            blocks.append(tuple(x - d + e for x, d, e in zip(full, dense_mlp, expert)))
        out.append(gpt_snapshot(profile, blocks, iterations=1.0, block_params=params, label=f"iteration {t}"))
    return out


def mixture_of_depths(layers: int, profile: Profile | None = None, snapshots: int = 24, every: int = 2,
                      capacity: float = 0.125, noise: float = 0.05, persistence: float = 0.9,
                      seed: int = 0) -> list[Snapshot]:
    """Blocks ``every-1, 2 every-1, ...`` take a routed fraction of the tokens that drifts
    around ``capacity`` (clipped to [1/64, 1]); one snapshot per iteration."""
    profile = profile or load_profile()
    rng = random.Random(seed)
    routed = {i: _ar1(rng, noise, persistence, snapshots) for i in range(layers) if (i + 1) % every == 0}
    out = []
    for t in range(snapshots):
        blocks = [profile.block(min(1.0, max(1 / 64, capacity + routed[i][t])) if i in routed else 1.0)
                  for i in range(layers)]
        out.append(gpt_snapshot(profile, blocks, iterations=1.0, label=f"iteration {t}"))
    return out


def sparse_attention(layers: int, profile: Profile | None = None, snapshots: int = 24, buckets: int = 4,
                     max_logit_std: float = 1.5, persistence: float = 0.9, seed: int = 0) -> list[Snapshot]:
    """Hash-bucketed causal attention: layer l computes sum_b p_b^2 of its score blocks, p_b the
    share of tokens in bucket b; one snapshot per iteration."""
    profile = profile or load_profile()
    rng = random.Random(seed)
    logits = [[_ar1(rng, rng.uniform(0.0, max_logit_std), persistence, snapshots) for _ in range(buckets)]
              for _ in range(layers)]
    full, attn = profile.block(1.0), profile.attention(1.0)
    out = []
    for t in range(snapshots):
        blocks = []
        for lg in logits:
            d = sum(p * p for p in _softmax([b[t] for b in lg]))
            blocks.append(tuple(x - a * (1 - d) for x, a in zip(full, attn)))
        out.append(gpt_snapshot(profile, blocks, iterations=1.0, label=f"iteration {t}"))
    return out


CASES: dict[str, Callable[..., list[Snapshot]]] = {
    "freezing": freezing,
    "early_exit": early_exit,
    "pruning": pruning,
    "moe": moe,
    "mod": mixture_of_depths,
    "sparse_attention": sparse_attention,
}
#: Cases whose routing changes every iteration (the paper invokes DynMo every iteration for them).
PER_ITERATION = ("moe", "mod", "sparse_attention")


def _as_snapshots(trajectory: Sequence[Snapshot | LayerCosts]) -> list[Snapshot]:
    return [s if isinstance(s, Snapshot) else Snapshot(s, 1.0, tuple(s.activation)) for s in trajectory]


# ------------------------------------------------------------------------------ comparison
def megatron_gpt_layout(num_layers: int, num_stages: int, prefix: int = 1, suffix: int = 2) -> Partition:
    """Megatron-LM's GPT layout: the transformer blocks split into equal counts (remainder on
    the first stages), the embedding (``prefix`` layers) added to the first stage and the final
    norm + head (``suffix`` layers) to the last. (The ``uniform`` balancer instead counts
    every pipeline layer, embedding and head included, as one.)"""
    from ..plan.balancers import megatron_layout

    blocks = num_layers - prefix - suffix
    if blocks < num_stages:
        return megatron_layout(num_layers, num_stages)
    sizes = list(megatron_layout(blocks, num_stages).sizes)
    sizes[0] += prefix
    sizes[-1] += suffix
    return Partition.from_sizes(sizes)


@dataclass(frozen=True)
class Comparison:
    step_time: dict[str, float]  # iteration-weighted seconds over the trajectory (+ migrations)
    bubble_fraction: dict[str, float]  # idle share of ranks x time
    speedup: dict[str, float]  # each dynamic balancer over the best static baseline
    rebalances: dict[str, int]  # applied (partition-changing) rebalances per dynamic balancer
    migration_seconds: dict[str, float]
    inherent_bubble: float  # the schedule's own bubble with equal stages and free links
    series: dict[str, list[float]]  # step seconds per snapshot, per strategy
    iterations: list[float]
    best_static: str
    best_dynamic: str
    partitions: dict[str, list[str]] = field(default_factory=dict)

    @property
    def best_speedup(self) -> float:
        return self.speedup[self.best_dynamic]


def migration_seconds(old: Partition, new: Partition, costs: LayerCosts, link: Link, ranks: int) -> float:
    """Time to move layers whose owner changes: each rank sends its leaving layers' state
    (``costs.memory``) over ``link``; ranks send in parallel, the slowest sets the time."""
    if old == new:
        return 0.0
    sent = [0.0] * ranks
    for layer in range(costs.num_layers):
        a, b = old.stage_of(layer) % ranks, new.stage_of(layer) % ranks
        if a != b:
            sent[a] += costs.memory[layer]
    return max(link.time(x) if x > 0 else 0.0 for x in sent)


def inherent_bubble(stages: int, schedule: str, microbatches: int) -> float:
    """Bubble of ``schedule`` with identical stages and free links ((p-1)/(m+p-1) for 1F1B)."""
    v = get_schedule(schedule).virtual_stages(None)
    from ..plan.balancers import megatron_layout

    return simulate(LayerCosts.uniform(stages * v), megatron_layout(stages * v, stages * v), schedule,
                    microbatches).bubble_fraction


def compare(
    trajectory: Sequence[Snapshot | LayerCosts],
    stages: int,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    *,
    link: Link | Sequence[Link] = Link(),
    dp: DataParallel | None = None,
    static: Sequence[str] = STATIC,
    dynamic: Sequence[str] = ("partition_time",),
    rebalance_every: int = 1,
    horizon: float = 10.0,
    migration_link: Link | None = None,
) -> Comparison:
    """Static partitions (decided once, on the first snapshot, as Megatron-LM / DeepSpeed do;
    ``megatron`` is :func:`megatron_gpt_layout`, the others are registered balancers)
    vs each ``dynamic`` balancer re-run every ``rebalance_every`` snapshots on the *previous*
    snapshot's costs (a step's routing is known only once it ran; the first decision uses the
    first snapshot). A dynamic decision is applied when its predicted saving over the next
    ``max(horizon, snapshot iterations)`` iterations exceeds its migration time (the strategy's
    ``auto`` rule); migrations are charged over ``migration_link`` (default: the slowest link).
    ``stages`` are pipeline ranks; multi-stage schedules get the table's default virtual stages.
    Micro-batches default to 4 x stages (the paper's appendix A)."""
    snaps = _as_snapshots(trajectory)
    spec = get_schedule(schedule)
    S, m = stages * spec.virtual_stages(None), microbatches or 4 * stages
    model = matching_cost_model(schedule, m, link)
    links = [link] if isinstance(link, Link) else list(link)
    mlink = migration_link or min(links, key=lambda x: x.bandwidth or math.inf)

    def balance(name: str, costs: LayerCosts, current: Partition | None) -> Partition:
        if name == "megatron":
            return megatron_gpt_layout(costs.num_layers, S)
        return get_balancer(name)(BalanceProblem(costs, S, model, current)).partition

    def run(costs_snap: Snapshot, part: Partition):
        return simulate(costs_snap.costs, part, schedule, m, link=link, dp=dp, reduced_params=costs_snap.reduced_params)

    fixed = {name: balance(name, snaps[0].costs, None) for name in static}
    names = (*fixed, *dynamic)
    total = dict.fromkeys(names, 0.0)
    busy = dict.fromkeys(names, 0.0)
    series: dict[str, list[float]] = {n: [] for n in names}
    parts: dict[str, list[str]] = {n: [] for n in names}
    current: dict[str, Partition | None] = dict.fromkeys(dynamic)
    applied = dict.fromkeys(dynamic, 0)
    moved = dict.fromkeys(dynamic, 0.0)
    for t, snap in enumerate(snaps):
        for name in dynamic:
            if t % rebalance_every:
                continue
            seen = snaps[max(0, t - 1)].costs
            cur = current[name]
            new = balance(name, seen, cur)
            if cur is None:
                current[name] = new
            elif new != cur:
                cost = migration_seconds(cur, new, seen, mlink, stages)
                gain = model.predicted_step_time(seen, cur) - model.predicted_step_time(seen, new)
                if gain * max(horizon, snap.iterations) > cost:
                    current[name], applied[name] = new, applied[name] + 1
                    moved[name] += cost
                    total[name] += cost
        for name in names:
            part = fixed.get(name) or current[name]
            r = run(snap, part)
            total[name] += snap.iterations * r.step_time
            busy[name] += snap.iterations * sum(r.busy)
            series[name].append(r.step_time)
            parts[name].append(str(part))
    best_static = min(fixed, key=lambda n: total[n])
    best_dynamic = min(dynamic, key=lambda n: total[n])
    return Comparison(
        step_time=total,
        bubble_fraction={n: 1 - busy[n] / (stages * total[n]) for n in names},
        speedup={n: total[best_static] / total[n] for n in dynamic},
        rebalances=applied,
        migration_seconds=moved,
        inherent_bubble=inherent_bubble(stages, schedule, m),
        series=series,
        iterations=[s.iterations for s in snaps],
        best_static=best_static,
        best_dynamic=best_dynamic,
        partitions=parts,
    )


# ------------------------------------------------------------------------------ re-packing
@dataclass(frozen=True)
class RepackProjection:
    ranks: list[int]  # pipeline ranks in use during each snapshot
    iterations: list[float]
    mean_ranks: float  # iteration-weighted
    gpu_hours_saved_fraction: float  # 1 - mean_ranks / stages
    throughput_ratio: list[float]  # packed throughput over the reference's, per snapshot
    peak_stage_memory_gb: list[float]  # of the pipeline in use (estimate; see Profile.stored_*)
    reasons: list[str]
    reference: str


def repack_projection(
    trajectory: Sequence[Snapshot],
    stages: int,
    schedule: str = "1f1b",
    *,
    link: Link | Sequence[Link] = Link(),
    dp: DataParallel | None = None,
    capacity: float = 80e9,
    tolerance: float = 0.05,
    balancer: str = "partition_time",
    reference: str = "start",
) -> RepackProjection:
    """At each snapshot, the fewest pipeline ranks whose time-balanced partition fits
    ``capacity`` bytes per GPU and whose simulated step stays within ``tolerance`` of the
    reference: ``"start"``, the balanced pipeline on ``stages`` ranks at the first snapshot
    (the paper's "sustaining the training throughput" as the model shrinks), or ``"current"``,
    the balanced pipeline on ``stages`` ranks at this snapshot (the runtime's ``repack="auto"``
    rule, which packs only what costs no throughput now). Partitions and micro-batches come from
    the library's :func:`~lightning_dynmo.plan.repack.plan_repack` (micro-batches re-tuned by the
    runtime's rule at a fixed global batch of 8 x stages samples); released GPUs do not come back,
    so a later snapshot can only pack further. ``link``: as in :func:`simulate`, the first
    ranks' links are kept."""
    if reference not in ("start", "current"):
        raise ValueError(f"reference must be 'start' or 'current', got {reference!r}")
    spec = get_schedule(schedule)
    v = spec.virtual_stages(None)
    batch = 8 * stages
    m0 = choose_microbatches(spec, batch, stages, v, None)
    links = [link] * stages if isinstance(link, Link) else list(link)
    model0 = matching_cost_model(schedule, m0, Link(), capacity=capacity)
    ranks_now, first = stages, None
    out_r, ratio, mem, why = [], [], [], []
    for snap in trajectory:
        mview = snap.memory_view()
        full = get_balancer(balancer)(BalanceProblem(mview, stages * v, model0)).partition
        base = simulate(snap.costs, full, schedule, m0, link=links, dp=dp, reduced_params=snap.reduced_params).step_time
        first = base if first is None else first
        ref = first if reference == "start" else base
        chosen, notes = None, []
        for r in range(1, ranks_now + 1):
            m = choose_microbatches(spec, batch, r, v, None) if r < stages else m0
            if r == stages:
                part = full
            else:
                try:
                    part = plan_repack(mview, full, model0, stages, r, balancer,
                                       lambda n: choose_microbatches(spec, batch, n, v, None), v, tolerance).partition
                except (RepackRefused, ValueError) as err:
                    notes.append(f"{r}: {err}"[:120])
                    continue
            scaled = rescale(snap.costs, m0 / m)
            step = simulate(scaled, part, schedule, m, link=links[:r], dp=dp, reduced_params=snap.reduced_params).step_time
            if step <= (1 + tolerance) * ref or r == ranks_now:
                model = matching_cost_model(schedule, m, Link(), capacity=capacity)
                chosen = (r, step, max(model.stage_memory(rescale(mview, m0 / m), part)) / 1e9)
                break
            notes.append(f"{r}: step {step * 1e3:.1f} ms > {1 + tolerance:.2f} x {ref * 1e3:.1f} ms")
        r, step, peak = chosen
        ranks_now = r
        out_r.append(r)
        ratio.append(ref / step)
        mem.append(peak)
        why.append(f"{r} ranks" + (f" (fewer refused: {notes[-1]})" if notes else ""))
    its = [s.iterations for s in trajectory]
    mean = sum(r * w for r, w in zip(out_r, its)) / sum(its)
    return RepackProjection(out_r, its, mean, 1 - mean / stages, ratio, mem, why, reference)
