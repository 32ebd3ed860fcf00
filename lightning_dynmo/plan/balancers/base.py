"""The balancer contract: ``balancer(BalanceProblem) -> BalanceResult``, plus shared objectives.

A balancer is a pure, deterministic function of the problem; it returns boundaries only, so it
cannot reorder layers. An *objective* says what "load of a stage" means for a balancer: per
micro-batch time (compute at the stage's speed + input receive, from the cost model), parameter
count, or layer count. Only time depends on rank speed: parameter and layer counts are static
proxies (what a static system balances, or what memory follows), the same on a slow rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cost_model import CostModel, LayerCosts
from ..partition import Partition


class InfeasiblePartitionError(ValueError):
    """No contiguous partition fits the per-stage memory capacity."""

    def __init__(self, capacity: float | None, min_peak_memory: float | None, num_layers: int, num_stages: int):
        self.capacity = capacity
        self.min_peak_memory = min_peak_memory
        cap = "the memory capacity" if capacity is None else f"the memory capacity of {capacity:.6g} bytes per stage"
        peak = "" if min_peak_memory is None else (
            f"; the smallest achievable peak stage memory is {min_peak_memory:.6g} bytes")
        super().__init__(f"no partition of {num_layers} layers into {num_stages} stages fits {cap}{peak}: raise "
                         "memory_capacity, spread the model over more pipeline stages, or trade compute for memory "
                         "with activation_checkpointing=True")


@dataclass(frozen=True)
class BalanceProblem:
    costs: LayerCosts
    num_stages: int
    model: CostModel
    current: Partition | None = None

    def __post_init__(self) -> None:
        L, S = self.costs.num_layers, self.num_stages
        if isinstance(S, bool) or int(S) != S or S < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {S!r}")
        object.__setattr__(self, "num_stages", int(S))
        if S > L:
            raise ValueError(f"cannot split {L} layers into {S} non-empty stages")
        cur = self.current
        if cur is not None:
            if not isinstance(cur, Partition):
                cur = Partition(tuple(cur))
                object.__setattr__(self, "current", cur)
            if cur.num_layers != L or cur.num_stages != S:
                raise ValueError(
                    f"current partition {cur} has {cur.num_layers} layers / {cur.num_stages} "
                    f"stages, the problem has {L} / {S}"
                )

    @property
    def num_layers(self) -> int:
        return self.costs.num_layers


@dataclass(frozen=True)
class BalanceResult:
    partition: Partition
    rounds: int  # diffusion rounds (including the final quiet one); 1 for one-shot balancers
    predicted_step_time: float  # model.predicted_step_time, whatever the balancer's objective
    max_load: float  # heaviest stage under the balancer's own objective (see ``loads``)
    name: str
    loads: tuple[float, ...] = ()  # per-stage loads under the balancer's objective


@dataclass(frozen=True)
class Objective:
    """Stage ``s``'s load ``(p[stop] - p[start]) / den / speed[s] + recv[s][start]``.

    ``p`` are exact int prefix sums, so the first term (the compute part) is monotone in both
    boundaries and is a lower bound of the load; ``recv[s]`` is stage ``s``'s input-transfer time
    by first layer, over the link it receives on (zeros except for time; stages on equally fast
    links share one list); ``speed`` is None (every stage at 1.0: no division) except for time.
    Bit-identical to ``CostModel.segment_time`` / ``LayerCosts.params_sum``.
    """

    kind: str
    p: list[int]
    den: int
    recv: Sequence[list[float]]
    speed: tuple[float, ...] | None = None

    def load(self, stage: int, start: int, stop: int) -> float:
        c = (self.p[stop] - self.p[start]) / self.den
        if self.speed is not None:
            c = c / self.speed[stage]
        return c + self.recv[stage][start]

    def loads(self, partition: Partition) -> tuple[float, ...]:
        b = partition.boundaries
        return tuple(self.load(s, b[s], b[s + 1]) for s in range(partition.num_stages))


def objective(kind: str, problem: BalanceProblem) -> Objective:
    costs, model, L, S = problem.costs, problem.model, problem.num_layers, problem.num_stages
    if kind == "time":
        pre = costs._time_prefix
        model.check_stages(S)
        by_link: dict[float | None, list[float]] = {}  # one receive column per distinct link (stage 0 receives nothing)
        recv = []
        for s in range(S):
            bw = model.link_bandwidth(s) if s else None
            if bw not in by_link:
                by_link[bw] = [model.recv_time(costs, i, s) if s else 0.0 for i in range(L + 1)]
            recv.append(by_link[bw])
        return Objective(kind, pre.p, pre.den, recv, model.speed)
    zeros = [0.0] * (L + 1)
    if kind == "params":
        return Objective(kind, costs._params_prefix, 1, [zeros] * S)
    if kind == "layers":
        return Objective(kind, list(range(L + 1)), 1, [zeros] * S)
    raise ValueError(f"unknown objective {kind!r}; valid: layers, params, time")


def fits_memory(problem: BalanceProblem, partition: Partition) -> bool:
    model = problem.model
    return model.capacity is None or max(model.stage_memory(problem.costs, partition)) <= model.capacity


def make_result(problem: BalanceProblem, obj: Objective, partition: Partition, name: str,
                rounds: int = 1) -> BalanceResult:
    loads = obj.loads(partition)
    return BalanceResult(
        partition=partition,
        rounds=rounds,
        predicted_step_time=problem.model.predicted_step_time(problem.costs, partition),
        max_load=max(loads),
        name=name,
        loads=loads,
    )
