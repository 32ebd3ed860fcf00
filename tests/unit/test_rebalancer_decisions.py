"""The rebalancer's decision path on a fake pipeline, in one process: profile reports -> merged
costs -> the balancer -> the decision record -> the migration plan. The pipeline's runtime objects
(layers, optimizers, engines, profiler, groups, shards) are stand-ins that fail the test when
anything reads or writes them, so the test shows that deciding, agreeing and recording touch no
runtime state: only the executor (``Rebalancer.execute``, replaced here by one that keeps the plan)
acts on a decision. The two pipeline ranks are played by one rank's reports (a one-rank world for
the agreements); the real path across ranks is tests/distributed/test_equivalence.py's."""
from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_dynmo.plan.layout import PipelineLayout
from lightning_dynmo.plan.migration_plan import MigrationPlan
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.schedules import get_schedule
from lightning_dynmo.plan.topology import Topology
from lightning_dynmo.runtime.migration import MigrationStats
from lightning_dynmo.strategy.options import PipelineOptions
from lightning_dynmo.strategy.rebalancer import Rebalancer
from lightning_dynmo.strategy.state import RankPipeline

L = 8
HEAVY = [(0.4, 0.8)] * 4 + [(0.05, 0.1)] * 4  # (forward, backward) s per micro-batch: the first half is heavy
START = Partition((0, 4, 8))


class Untouchable:
    """A runtime object the decision path must leave alone: any use fails the test."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        raise AssertionError(f"the decision path used the pipeline's {self._name}.{attr}")

    def __setattr__(self, attr, value):
        raise AssertionError(f"the decision path wrote the pipeline's {self._name}.{attr}")

    def __iter__(self):
        raise AssertionError(f"the decision path iterated the pipeline's {self._name}")

    def __len__(self):
        raise AssertionError(f"the decision path took the length of the pipeline's {self._name}")

    def __getitem__(self, key):
        raise AssertionError(f"the decision path indexed the pipeline's {self._name}")


class TiedLog:
    """Tied parameters: a migration tells them the new layout (recorded)."""

    def __init__(self) -> None:
        self.layouts: list[PipelineLayout] = []

    def update(self, layout, timeout) -> None:
        self.layouts.append(layout)


class Module:
    """What the recorder needs of the LightningModule: ``log`` (recorded) and the log directory."""

    def __init__(self, log_dir) -> None:
        self.logged: dict[str, float] = {}
        self.trainer = type("Trainer", (), {"log_dir": str(log_dir), "default_root_dir": str(log_dir)})()

    def log(self, name, value, **_) -> None:
        self.logged[name] = value


def pp2_layout(partition: Partition) -> PipelineLayout:
    return PipelineLayout(Topology(2, 2), get_schedule("1f1b"), 1, 0, partition)


def fake_pipeline(tmp_path, partition: Partition = START) -> RankPipeline:
    names = ("layers", "optimizers", "optimizer_layout", "profiler", "engines", "expert_parallel", "groups",
             "dp_sharding")
    return RankPipeline(module=Module(tmp_path), layers_attr="layers", tied=TiedLog(), full_state_shapes={},
                        layout=pp2_layout(partition), device=torch.device("cpu"), global_rank=0,
                        last_batch_size=16, last_microbatches=8, **{n: Untouchable(n) for n in names})


def profile_reports(partition: Partition, work=HEAVY) -> list[tuple[dict, dict]]:
    """What ``gather_layer_costs`` gathers from the two pipeline ranks after a profile window:
    ``(report, fresh)`` per rank, ``report`` with parameter counts and memory, ``fresh`` the
    window's times of the rank's layers."""
    out = []
    for rank in range(2):
        layers = [i for i in range(L) if partition.stage_of(i) == rank]
        out.append(({i: (math.nan, math.nan, 100, 4e3) for i in layers}, {i: work[i] for i in layers}))
    return out


def rebalancer(**options) -> tuple[Rebalancer, list[MigrationPlan]]:
    options.setdefault("rebalance", "on_event")
    rb = Rebalancer(PipelineOptions(pipeline_parallel=2, balancer="partition_time", **options))
    plans: list[MigrationPlan] = []

    def execute(plan, pipe):  # the executor: the one part of a migration that writes runtime state
        plans.append(plan)
        return MigrationStats(layers_sent=len(plan.moves), bytes_sent=1000 * len(plan.moves))

    rb.execute = execute
    return rb, plans


def history(tmp_path) -> list[dict]:
    with open(tmp_path / "rebalance_history.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_profile_to_plan_decides_records_and_hands_the_executor_the_plan(world_of_one, tmp_path):
    rb, plans = rebalancer()
    pipe = fake_pipeline(tmp_path)
    costs = rb.work_of_reports(profile_reports(START), pipe.layout, L, None, event=False, rank=0)
    assert costs.forward == tuple(f for f, _ in HEAVY) and costs.params == (100,) * L
    change = rb._rebalance(5, "a test", costs, [], pipe)
    decision = rb.recorder.decisions[-1]
    assert decision.applied and decision.kind == "rebalance" and decision.step == 5
    new = change.layout.partition
    assert str(new) == decision.after and new != START
    assert decision.predicted_step_after < decision.predicted_step_before
    # the plan the executor got moves exactly the layers whose owner changed, from the old one to the new
    assert plans == [MigrationPlan.build(START, new, pipe.layout.rank_of_stage)]
    assert {m.layer for m in plans[0].moves} == {i for i in range(L) if START.stage_of(i) != new.stage_of(i)}
    assert pipe.tied.layouts == [change.layout]
    assert decision.migration_bytes == 1000 * len(plans[0].moves)
    # the record: one line of rebalance_history.jsonl, the metrics, the new boundaries
    assert history(tmp_path) == [decision.to_record()]
    assert pipe.module.logged["partition/b1"] == float(new.boundaries[1])
    assert pipe.module.logged["rebalance/predicted_step_after"] == pytest.approx(decision.predicted_step_after)
    assert pipe.layout.partition == START  # the pipeline value is not written either: the change is returned


@pytest.mark.parametrize("case", ["balanced", "refused"])
def test_a_decision_that_moves_nothing_calls_no_executor(world_of_one, tmp_path, case):
    if case == "balanced":  # equal layers on an equal split
        rb, plans = rebalancer()
        work = [(0.1, 0.2)] * L
    else:  # auto: the gain over one step does not pay for a migration measured at 100 s
        rb, plans = rebalancer(rebalance="auto", rebalance_horizon=1)
        rb.controller.migrated(0.0, cost=100.0)
        work = HEAVY
    pipe = fake_pipeline(tmp_path)
    costs = rb.work_of_reports(profile_reports(START, work), pipe.layout, L, None, event=False, rank=0)
    assert rb._rebalance(3, "a test", costs, [], pipe) is None
    decision = rb.recorder.decisions[-1]
    assert not decision.applied and plans == [] and pipe.tied.layouts == []
    assert ("already balanced" if case == "balanced" else "<= cost") in decision.why
    assert history(tmp_path) == [decision.to_record()]


def test_costs_from_reports_write_nothing_but_the_rebalancers_own_record(world_of_one, tmp_path):
    """Merging the reports is pure in what it is given: the reports and the layout are unchanged."""
    rb, _ = rebalancer()
    pipe = fake_pipeline(tmp_path)
    reports = profile_reports(START)
    before = json.dumps([[sorted(r.items()), sorted(f.items())] for r, f in reports])
    first = rb.work_of_reports(reports, pipe.layout, L, [1.0] * L, event=False, rank=0)
    assert rb.work_of_reports(reports, pipe.layout, L, [1.0] * L, event=False, rank=0) == first
    assert json.dumps([[sorted(r.items()), sorted(f.items())] for r, f in reports]) == before
    assert first.activation == (1.0,) * L
