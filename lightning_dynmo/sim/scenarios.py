"""Synthetic per-layer cost trajectories of the six dynamism cases, and static vs dynamic balancing
of them in the simulator.

These are *models*, not measurements: each case turns a few stated parameters into per-layer
multipliers of one transformer block's cost (:class:`BlockShape`, the DynMo paper's appendix-A
block by default: hidden 1024, sequence 2048, micro-batch 2, costed by FLOPs at an assumed
effective rate). Layers are the transformer blocks only (no embedding or head), so the static
baselines start balanced and every imbalance comes from the dynamism. Random draws are seeded.

A block's forward FLOPs split into dense matmuls (QKV/output 8 b s h^2, MLP 16 b s h^2) and
attention scores/context (4 b s^2 h); backward is 2x forward. Token-dropping cases (early exit,
MoD) scale the whole block linearly in the token fraction (the quadratic attention part is
treated as linear: a simplification).
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..plan.balancers import BalanceProblem, get_balancer
from ..plan.cost_model import LayerCosts
from ..plan.partition import Partition
from ..plan.schedules import get_schedule
from .simulate import DataParallel, Link, matching_cost_model, simulate


@dataclass(frozen=True)
class BlockShape:
    hidden: int = 1024
    seq: int = 2048
    micro_batch: int = 2
    flops_per_second: float = 4e14  # effective bf16 rate (~40 % of an H100's dense peak)
    bytes_per_value: int = 2

    @property
    def matmul_flops(self) -> float:
        return 24 * self.micro_batch * self.seq * self.hidden**2

    @property
    def attention_flops(self) -> float:
        return 4 * self.micro_batch * self.seq**2 * self.hidden

    @property
    def mlp_share(self) -> float:
        return 16 * self.micro_batch * self.seq * self.hidden**2 / (self.matmul_flops + self.attention_flops)

    @property
    def attention_share(self) -> float:
        return self.attention_flops / (self.matmul_flops + self.attention_flops)

    def costs(self, scale: Sequence[float], backward_scale: Sequence[float] | None = None,
              params: Sequence[int] | None = None) -> LayerCosts:
        """Per-layer costs of blocks whose forward (and backward) work is scaled by ``scale``."""
        fwd = (self.matmul_flops + self.attention_flops) / self.flops_per_second
        bwd_scale = scale if backward_scale is None else backward_scale
        n = len(scale)
        params = [12 * self.hidden**2 + 13 * self.hidden] * n if params is None else list(params)
        act = self.micro_batch * self.seq * self.hidden * self.bytes_per_value
        return LayerCosts([fwd * x for x in scale], [2 * fwd * x for x in bwd_scale], params,
                          [16.0 * p for p in params], [float(act)] * n)


def freezing(layers: int, shape: BlockShape = BlockShape(), steps: int = 12, final_frozen: float = 0.75) -> list[LayerCosts]:
    """A frozen prefix grows linearly from 0 to ``final_frozen`` of the layers; frozen prefix
    layers need no backward at all (nothing below them needs gradients)."""
    out = []
    for t in range(steps):
        k = round(final_frozen * layers * t / max(1, steps - 1))
        out.append(shape.costs([1.0] * layers, [0.0] * k + [1.0] * (layers - k)))
    return out


def early_exit(layers: int, shape: BlockShape = BlockShape(), steps: int = 12,
               exits: Sequence[float] = (0.25, 0.5, 0.75), final_exit_rate: float = 0.5) -> list[LayerCosts]:
    """Exit points before layers ``round(q L)``; at each, a share of the remaining tokens leaves
    that grows linearly to ``final_exit_rate`` as the model becomes confident."""
    points = [round(q * layers) for q in exits]
    out = []
    for t in range(steps):
        e = final_exit_rate * t / max(1, steps - 1)
        out.append(shape.costs([(1 - e) ** sum(x <= layer for x in points) for layer in range(layers)]))
    return out


def pruning(layers: int, shape: BlockShape = BlockShape(), sparsities: Sequence[float] = (0.0, 0.52, 0.79, 0.90),
            spread: float = 0.35, break_even_density: float = 0.25, seed: int = 0) -> list[LayerCosts]:
    """Global magnitude pruning, one step per sparsity level. Layer l's weights ~ N(0, s_l^2)
    with log s_l ~ N(0, spread^2); one global threshold keeps density erfc(tau / (s_l sqrt 2)) of
    layer l, tau chosen so that the mean density is 1 - sparsity. Matmuls run on a sparse kernel
    that costs ``density / break_even_density`` of dense, dense when that is cheaper (the
    Sputnik anchor: break-even near 75 % sparsity); attention scores stay dense."""
    rng = random.Random(seed)
    sigma = [math.exp(spread * rng.gauss(0.0, 1.0)) for _ in range(layers)]

    def density(tau: float) -> list[float]:
        return [math.erfc(tau / (s * math.sqrt(2))) for s in sigma]

    out = []
    for sparsity in sparsities:
        lo, hi = 0.0, 10.0 * max(sigma)
        for _ in range(100):  # bisection on the global threshold
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(density(mid)) / layers > 1 - sparsity else (lo, mid)
        matmul = 1 - shape.attention_share
        out.append(shape.costs([shape.attention_share + matmul * min(1.0, d / break_even_density) for d in density(hi)]))
    return out


def _drift(rng: random.Random, mean: float, noise: float, persistence: float, steps: int) -> list[float]:
    """AR(1) around ``mean``: stationary std ``noise``, step-to-step correlation ``persistence``
    (routing statistics drift over training rather than being redrawn each step)."""
    x, out = mean + noise * rng.gauss(0.0, 1.0), []
    for _ in range(steps):
        out.append(x)
        x = mean + persistence * (x - mean) + noise * math.sqrt(1 - persistence**2) * rng.gauss(0.0, 1.0)
    return out


def moe(layers: int, shape: BlockShape = BlockShape(), steps: int = 12, every: int = 2, experts: int = 8,
        top_k: int = 2, capacity_factor: float = 1.25, concentration: float = 2.0, persistence: float = 0.9,
        seed: int = 0) -> list[LayerCosts]:
    """Every ``every``-th block has ``experts`` MLP experts (top-k routing; an expert processes at
    most ``capacity_factor x k T / E`` tokens, the rest are dropped, so skewed routing costs
    less). A layer's routing shares are the normalised ``exp`` of AR(1) logits with stationary
    std ``1 / sqrt(concentration x c_l)``, c_l ~ LogNormal(0, 1) per layer (some layers route far
    less evenly), correlation ``persistence`` step to step. Parameters: E x the MLP's, which the
    ``param`` baseline sees."""
    rng = random.Random(seed)
    moe_layers = [layer for layer in range(layers) if layer % every == every - 1]
    logits = {}
    for layer in moe_layers:
        spread = 1 / math.sqrt(concentration * math.exp(rng.gauss(0.0, 1.0)))
        logits[layer] = [_drift(rng, 0.0, spread, persistence, steps) for _ in range(experts)]
    dense = 12 * shape.hidden**2 + 13 * shape.hidden
    params = [dense + (experts - 1) * 8 * shape.hidden**2 if layer in logits else dense for layer in range(layers)]
    out = []
    for t in range(steps):
        scale = []
        for layer in range(layers):
            if layer not in logits:
                scale.append(1.0)
                continue
            w = [math.exp(e[t]) for e in logits[layer]]
            processed = top_k * sum(min(x / sum(w), capacity_factor / experts) for x in w)  # x dense MLP tokens
            scale.append(1 - shape.mlp_share + shape.mlp_share * processed)
        out.append(shape.costs(scale, params=params))
    return out


def mixture_of_depths(layers: int, shape: BlockShape = BlockShape(), steps: int = 12, every: int = 2,
                      mean_range: tuple[float, float] = (0.125, 0.5), noise: float = 0.1, persistence: float = 0.9,
                      seed: int = 0) -> list[LayerCosts]:
    """Every ``every``-th block is routed: its token fraction drifts (AR(1), std ``noise``,
    correlation ``persistence``) around a per-block mean ~ U(mean_range), clipped to [0.05, 1];
    other blocks see every token."""
    rng = random.Random(seed)
    frac = {layer: _drift(rng, rng.uniform(*mean_range), noise, persistence, steps)
            for layer in range(layers) if layer % every == every - 1}
    return [
        shape.costs([min(1.0, max(0.05, frac[layer][t])) if layer in frac else 1.0 for layer in range(layers)])
        for t in range(steps)
    ]


def sparse_attention(layers: int, shape: BlockShape = BlockShape(), steps: int = 12,
                     mean_range: tuple[float, float] = (0.05, 0.6), noise: float = 0.05, persistence: float = 0.9,
                     seed: int = 0) -> list[LayerCosts]:
    """Hash-bucketed attention: layer l computes a block density of its score matrix that
    drifts (AR(1), std ``noise``, correlation ``persistence``) around a mean ~ U(mean_range),
    clipped to [0.02, 1]; only the attention share of the block (25 % at sequence 2048, more for
    longer sequences) scales with it."""
    rng = random.Random(seed)
    density = [_drift(rng, rng.uniform(*mean_range), noise, persistence, steps) for _ in range(layers)]
    a = shape.attention_share
    return [shape.costs([1 - a + a * min(1.0, max(0.02, d[t])) for d in density]) for t in range(steps)]


CASES: dict[str, Callable[..., list[LayerCosts]]] = {
    "freezing": freezing,
    "early_exit": early_exit,
    "pruning": pruning,
    "moe": moe,
    "mod": mixture_of_depths,
    "sparse_attention": sparse_attention,
}


@dataclass(frozen=True)
class Comparison:
    step_time: dict[str, float]  # summed simulated step times over the trajectory, per strategy
    bubble_fraction: dict[str, float]  # idle share of ranks x summed step time, per strategy
    speedup: dict[str, float]  # dynamic over each static baseline (summed step times)
    rebalances: int


def compare(
    trajectory: Sequence[LayerCosts],
    stages: int,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    *,
    link: Link = Link(),
    dp: DataParallel | None = None,
    rebalance_every: int = 1,
    balancer: str = "partition_time",
) -> Comparison:
    """Static ``uniform`` / ``param`` partitions (decided once, on the first step's costs) vs
    ``balancer`` re-run every ``rebalance_every`` steps on the *previous* step's costs (a step's
    routing is known only once it ran; the first decision uses the first step). ``stages`` are
    pipeline ranks; multi-stage schedules get the table's default virtual stages per rank.
    Migration cost is not charged."""
    S, m = stages * get_schedule(schedule).virtual_stages(None), microbatches or 4 * stages
    model = matching_cost_model(schedule, m, link)

    def balance(name: str, costs: LayerCosts, current: Partition | None) -> Partition:
        return get_balancer(name)(BalanceProblem(costs, S, model, current)).partition

    fixed = {name: balance(name, trajectory[0], None) for name in ("uniform", "param")}
    totals = {name: 0.0 for name in (*fixed, "dynamic")}
    busy = dict.fromkeys(totals, 0.0)
    dynamic, rebalances = None, 0
    for t, costs in enumerate(trajectory):
        if t % rebalance_every == 0:
            dynamic = balance(balancer, trajectory[max(0, t - 1)], dynamic)
            rebalances += 1
        for name, part in (*fixed.items(), ("dynamic", dynamic)):
            r = simulate(costs, part, schedule, m, link=link, dp=dp)
            totals[name] += r.step_time
            busy[name] += sum(r.busy)
    return Comparison(
        step_time=totals,
        bubble_fraction={n: 1 - busy[n] / (stages * totals[n]) for n in totals},
        speedup={n: totals[n] / totals["dynamic"] for n in fixed},
        rebalances=rebalances,
    )
