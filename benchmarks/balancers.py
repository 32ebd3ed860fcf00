"""Balancer quality and speed on random instances: max stage time / optimal max stage time.

Instances: 4-96 layers on 2-32 stages (1F1B, m = 4 x stages), per-layer costs of one of five
shapes, each instance with a 1-in-3 chance of a finite link bandwidth (input-receive time joins
the stage load; on every other such instance one per stage boundary, 8x slower every fourth) and
of a per-stage memory capacity 5-30 % above the smallest feasible peak:

* ``uniform``: forward 1, backward 2 for every layer;
* ``lognormal``: forward ~ LogNormal(0, 0.6), backward 2 x forward x U(0.8, 1.2);
* ``few_heavy``: one layer in 16 (at least one) is 4-16x heavier (a head, a wide MLP);
* ``frozen_prefix``: the first k ~ U{1..L-1} layers are frozen and skip backward entirely;
* ``early_exit``: three exit points, each keeps a U(0.3, 0.7) share of the tokens.

The optimum comes from an independent oracle, a textbook O(S L^2) dynamic programme over the
public ``CostModel`` (no pruning, no shared code with the balancers). Every balancer starts from
the Megatron layout as ``current`` (the running partition), so ``moved`` is the number of layers
a rebalance would migrate. ``diffusion_pairs_only`` is diffusion without widening runs: the
local fixed point that stalls on staircases.

Last line: JSON with ``partition_optimal_fraction`` (partition_time and partition_param exact on
every instance: 1.0), ``partition_ms_96x32`` and ``partition_ms_200x32`` (mean ms of
partition_time on 96 or 200 layers x 32 stages, bandwidth and capacity on, every shape; ``_nodes``:
one bandwidth per stage boundary, 8x slower every fourth; the ``partition_max_ms_*`` keys give the
slowest call, ``partition_cpu_ms_*`` the mean process CPU time, which a loaded machine inflates
least; target for 200 x 32: under 50 ms), ``diffusion_mean_ratio`` / ``diffusion_worst_ratio``
(diffusion_time), ``diffusion_param_worst_ratio`` (max stage parameters / optimum) and per
balancer mean / worst ratio, worst ratio per shape, ms per call and layers moved.

    python benchmarks/balancers.py [--quick]
    python benchmarks/balancers.py --smoke     # seconds: 10 instances of at most 24 layers, one timing call each
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer, megatron_layout
from lightning_dynmo.plan.balancers.diffusion import diffuse
from lightning_dynmo.plan.balancers.exact import min_peak_memory
from lightning_dynmo.plan.cost_model import CostModel, LayerCosts

SHAPES = ("uniform", "lognormal", "few_heavy", "frozen_prefix", "early_exit")
SPEED_SIZES = ((96, 32), (200, 32))  # layers x stages timed with links and memory on (target: 200 x 32 < 50 ms)
BALANCERS = ("uniform", "param", "partition_time", "partition_param", "diffusion_time", "diffusion_param")
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "instances", "partition_optimal_fraction", "partition_ms_96x32", "partition_ms_200x32",
               "partition_cpu_ms_200x32", "diffusion_mean_ratio", "diffusion_worst_ratio",
               "diffusion_param_worst_ratio", "balancers")


def layer_times(rng: random.Random, shape: str, L: int) -> tuple[list[float], list[float]]:
    if shape == "uniform":
        return [1.0] * L, [2.0] * L
    if shape == "lognormal":
        f = [rng.lognormvariate(0.0, 0.6) for _ in range(L)]
        return f, [2 * x * rng.uniform(0.8, 1.2) for x in f]
    if shape == "few_heavy":
        f = [1.0] * L
        for i in rng.sample(range(L), max(1, L // 16)):
            f[i] = rng.uniform(4.0, 16.0)
        return f, [2 * x for x in f]
    if shape == "frozen_prefix":
        k = rng.randint(1, L - 1)
        return [1.0] * L, [0.0] * k + [2.0] * (L - k)
    if shape == "early_exit":
        exits, keep, f = set(rng.sample(range(1, L), min(L - 1, 3))), 1.0, []
        for layer in range(L):
            if layer in exits:
                keep *= rng.uniform(0.3, 0.7)
            f.append(keep)
        return f, [2 * x for x in f]
    raise ValueError(shape)


def instance(rng: random.Random, shape: str, L: int, S: int, links: bool | str, memory: bool) -> BalanceProblem:
    """Times in abstract units; parameter counts about equal per layer and independent of the
    time shape (frozen or early-exit layers keep their weights), as a static partitioner sees.
    ``links="nodes"``: one bandwidth per stage boundary, 8x faster inside nodes of 4 stages."""
    f, b = layer_times(rng, shape, L)
    params = [rng.randint(900_000, 1_100_000) for _ in range(L)]
    costs = LayerCosts(f, b, params, [16.0 * p for p in params], [rng.uniform(2e5, 4e5) for _ in range(L)])
    bandwidth = 1e6 if links else None  # ~0.5 of a unit-time layer per link crossing
    if links == "nodes":
        bandwidth = tuple(1e6 if s % 4 == 3 else 8e6 for s in range(S - 1))
    model = CostModel(4 * S, "1f1b", bandwidth=bandwidth)
    if memory:
        loose = BalanceProblem(costs, S, model)
        cap = min_peak_memory(loose) * rng.uniform(1.05, 1.3)
        model = CostModel(4 * S, "1f1b", bandwidth=bandwidth, capacity=cap)
    return BalanceProblem(costs, S, model, megatron_layout(L, S))


def oracle(problem: BalanceProblem, load) -> float:
    """Optimal max stage ``load(s, i, j)`` subject to memory: best[s][j] = min_i max(best[s-1][i],
    load(s, i, j)), every (i, j) tried."""
    L, S, model, costs = problem.num_layers, problem.num_stages, problem.model, problem.costs
    best = [0.0] + [math.inf] * L
    for s in range(S):
        cur = [math.inf] * (L + 1)
        for j in range(s + 1, L - (S - 1 - s) + 1):
            for i in range(s, j):
                if model.capacity is None or model.fits(model.segment_memory(costs, i, j, s, S)):
                    cur[j] = min(cur[j], max(best[i], load(s, i, j)))
        best = cur
    return best[L]


def run(instances: int, seed: int, max_layers: int = 96, reps: int = 3) -> dict:
    rng = random.Random(seed)
    names = (*BALANCERS, "diffusion_pairs_only")
    ratio = {n: [] for n in names}
    worst_by_shape = {n: {s: 1.0 for s in SHAPES} for n in names}
    ms = {n: [] for n in names}
    moved = {n: [] for n in names}
    optimal, param_ratio = [], []
    for k in range(instances):
        shape = SHAPES[k % len(SHAPES)]
        L = rng.randint(4, max_layers)
        S = rng.randint(2, min(32, L))
        links = rng.random() < 1 / 3
        problem = instance(rng, shape, L, S, links and ("nodes" if k % 2 else True), rng.random() < 1 / 3)
        model, costs = problem.model, problem.costs
        opt_time = oracle(problem, lambda s, i, j: model.segment_time(costs, i, j, s))
        opt_params = oracle(problem, lambda s, i, j: costs.params_sum(i, j))
        for n in names:
            t0 = time.perf_counter()
            if n == "diffusion_pairs_only":
                r = diffuse(problem, "time", n, widen=False)
            else:
                r = get_balancer(n)(problem)
            ms[n].append((time.perf_counter() - t0) * 1e3)
            part = r.partition
            worst_time = max(model.stage_times(costs, part))
            ratio[n].append(worst_time / opt_time)
            worst_by_shape[n][shape] = max(worst_by_shape[n][shape], ratio[n][-1])
            moved[n].append(part.moved_layers(problem.current))
            peak_params = max(costs.stage_params(part))
            if n == "partition_time":
                optimal.append(worst_time == opt_time)
            elif n == "partition_param":
                optimal.append(peak_params == opt_params)
            elif n == "diffusion_param":
                param_ratio.append(peak_params / opt_params)
    speed: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # process CPU time: what a loaded machine inflates least
    for L, S in SPEED_SIZES:
        for links, tag in ((True, ""), ("nodes", "_nodes")):  # one bandwidth / one per boundary
            key = f"{L}x{S}{tag}"
            speed[key], cpu[key] = [], []
            for shape in SHAPES:
                problem = instance(random.Random(seed + 1), shape, L, S, links, True)
                for _ in range(reps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    get_balancer("partition_time")(problem)
                    speed[key].append((time.perf_counter() - t0) * 1e3)
                    cpu[key].append((time.process_time() - c0) * 1e3)
    table = {
        n: {
            "mean_ratio": round(statistics.fmean(ratio[n]), 4),
            "worst_ratio": round(max(ratio[n]), 4),
            "worst_ratio_by_shape": {s: round(v, 4) for s, v in worst_by_shape[n].items()},
            "mean_ms": round(statistics.fmean(ms[n]), 3),
            "mean_moved_layers": round(statistics.fmean(moved[n]), 2),
        }
        for n in names
    }
    return {
        "benchmark": "balancers",
        "instances": instances,
        "partition_optimal_fraction": statistics.fmean(optimal),
        **{f"partition_ms_{k}": round(statistics.fmean(v), 2) for k, v in speed.items()},
        **{f"partition_max_ms_{k}": round(max(v), 2) for k, v in speed.items()},
        **{f"partition_cpu_ms_{k}": round(statistics.fmean(v), 2) for k, v in cpu.items()},
        "diffusion_mean_ratio": table["diffusion_time"]["mean_ratio"],
        "diffusion_worst_ratio": table["diffusion_time"]["worst_ratio"],
        "diffusion_param_worst_ratio": round(max(param_ratio), 4),
        "balancers": table,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="150 instances instead of 1000")
    ap.add_argument("--smoke", action="store_true",
                    help="10 small instances, one timing call per size: checks that the script runs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.smoke:
        out = dict(run(10, args.seed, max_layers=24, reps=1), smoke=True)
    else:
        out = run(150 if args.quick else 1000, args.seed)
    print(f"{'balancer':22s} {'mean':>7s} {'worst':>7s} {'ms':>8s} {'moved':>7s}   worst by shape")
    for n, row in out["balancers"].items():
        shapes = " ".join(f"{s}={v:.2f}" for s, v in row["worst_ratio_by_shape"].items())
        print(f"{n:22s} {row['mean_ratio']:7.3f} {row['worst_ratio']:7.3f} {row['mean_ms']:8.2f} "
              f"{row['mean_moved_layers']:7.1f}   {shapes}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
