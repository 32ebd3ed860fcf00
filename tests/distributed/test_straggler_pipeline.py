"""A genuinely slower rank under ``rebalance="auto"``: global rank 1 runs every layer's forward 4
times (the extra runs under no_grad: the math is unchanged) during steps 10-19 only, wherever the
layers are. The pipeline moves work off it in proportion to its measured speed, says so in the
record and the summary, moves back when it recovers, and trains exactly like one process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.test_equivalence import base, check_against_reference
from tests.support.multiproc import run_worker

from lightning_dynmo.strategy.recorder import dynmo_summary_text

pytestmark = pytest.mark.slow
SLOW = {"rank": 1, "start": 10, "stop": 20, "repeat": 4}
CFG = base(steps=30, clip=1.0, partition=[0, 1, 9], rebalance="auto", balancer="partition_time", rebalance_cooldown=3,
           overhead_budget=float("inf"), slow=SLOW)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("straggler"), 2, [CFG], timeout=400)[0]


def boundary(partition: str) -> int:
    return int(partition.split("|")[1].split("-")[0])


def test_a_slow_rank_gets_less_work_in_proportion_and_gets_it_back_when_it_recovers(result):
    res = result
    decisions = [h for h in res["history"] if h["kind"] == "rebalance"]
    applied = [h for h in decisions if h["applied"]]
    # the lopsided start is left at once, for ranks alike
    assert applied and applied[0]["step"] <= 2 and "straggler" not in applied[0], decisions
    # equal ranks (steps 2-9): the speed watch never fires (its hysteresis holds in the real run)
    assert not [h for h in decisions if h["step"] < SLOW["start"] and "relative speed" in h["reason"]], decisions
    # the slowdown: caught within a few steps, at the first decision, for rank 1
    slow = [h for h in applied if SLOW["start"] < h["step"] < SLOW["stop"]]
    assert slow and slow[0]["step"] <= SLOW["start"] + 6, decisions
    move = slow[0]
    assert move["straggler"].startswith("pipeline rank 1 at "), move
    v = move["speeds"][1]
    assert move["straggler"] == f"pipeline rank 1 at {v:.2f}x" and move["speeds"][0] == 1.0
    # ... at the speed its busy time shows: rank 1's busy share against rank 0's, same partition,
    # before the slowdown and on its first step (before any move)
    busy = res["rank_busy"]
    before = sum(busy[s][1] / busy[s][0] for s in range(SLOW["start"] - 3, SLOW["start"])) / 3
    measured = before / (busy[SLOW["start"]][1] / busy[SLOW["start"]][0])
    assert 0.25 < v < 0.8 and 0.6 < v / measured < 1 / 0.6, (v, measured, busy)
    # ... and the split follows it: the best split of the work at those speeds (the cost trace of
    # that decision), which gives rank 1 less work than at equal speeds
    traces = {t["step"]: t for t in map(json.loads, open(Path(res["root_dir"]) / "cost_trace.jsonl"))}
    t = traces[move["step"]]
    assert t["rank_speed"] == move["speeds"]
    work = [f + b for f, b in zip(t["forward"], t["backward"])]

    def slowest(cut, speeds):
        return max(sum(work[:cut]) / speeds[0], sum(work[cut:]) / speeds[1])

    cuts = range(1, len(work))
    best = min(slowest(c, move["speeds"]) for c in cuts)
    assert slowest(boundary(move["after"]), move["speeds"]) <= best * (1 + 1e-9), (move, t)
    equal = min(cuts, key=lambda c: (slowest(c, (1.0, 1.0)), c))
    assert boundary(move["after"]) > equal, (move, work)
    share = sum(work[boundary(move["after"]):]) / sum(work)  # rank 1's share of the work, about v / (1 + v)
    assert share < 0.5 and abs(share - v / (1 + v)) < max(work) / sum(work), (share, v, work)
    # recovery: the work goes back, balanced for ranks alike again
    back = [h for h in applied if h["step"] > SLOW["stop"]]
    assert back and boundary(back[0]["after"]) < boundary(move["after"]), decisions
    assert min(back[0].get("speeds") or [1.0]) > 0.75, back[0]
    # every speed-aware decision is in the JSONL history and the fit summary
    lines = [json.loads(line) for line in (Path(res["root_dir"]) / "rebalance_history.jsonl").read_text().splitlines()]
    assert lines == res["history"]
    assert {"step": move["step"], "straggler": move["straggler"], "applied": True} in res["summary"]["stragglers"]
    assert f"step {move['step']}: balanced for {move['straggler']}" in dynmo_summary_text(res["summary"])


def test_a_straggler_changes_where_layers_run_never_the_math(result):
    check_against_reference(result, CFG)
