"""The paper-scale projection (lightning_dynmo.sim.scenarios.projection, recipes/paper_scale.py) on a tiny
grid, and the pieces it is built from: the measured profile, the Megatron layout, the MoE routing
calibration, re-packing."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.sim import Link
from lightning_dynmo.sim.scenarios.projection import DEFAULTS, links, merged, project
from lightning_dynmo.sim.scenarios import (CASES, DEFAULT_PROFILE, Profile, _softmax, dense, freezing,
                                           logit_std_for_spread, megatron_gpt_layout, pruning, repack_projection)

REPO = Path(__file__).resolve().parents[2]


def test_measured_profile():
    p = Profile.load(DEFAULT_PROFILE)
    assert "measured" in p.source and (p.hidden, p.heads, p.seq, p.micro_batch) == (1024, 32, 2048, 2)
    fwd = [p.block(f)[0] for f in (0.1, 0.25, 0.5, 0.75, 1.0)]
    assert fwd == sorted(fwd) and fwd[-1] > fwd[0]  # more tokens never cost less (isotonic fit)
    assert 0 < p.attention(1.0)[0] < p.block(1.0)[0] and 0 < p.block_weights_only_backward() <= p.block(1.0)[1] * 1.01
    assert sum(p.head) > 2 * sum(p.block(1.0))  # the LM head + fp32 loss is several blocks' worth
    assert p.mlp(16384)[0] > p.mlp(4096)[0] and p.mlp(0) == (0.0, 0.0)
    assert p.mlp(65536)[0] > p.mlp(32768)[0]  # linear extrapolation beyond the table
    flops = Profile.from_flops()
    assert "not measured" in flops.source and flops.block(0.5)[0] < flops.block(1.0)[0]
    with pytest.raises(FileNotFoundError, match="bundled"):
        Profile.load("no_such_profile")


def test_megatron_layout_puts_embedding_and_head_on_the_ends():
    assert megatron_gpt_layout(51, 24).sizes == (3,) + (2,) * 22 + (4,)
    assert megatron_gpt_layout(11, 2) == Partition((0, 5, 11))
    assert megatron_gpt_layout(5, 4) == Partition((0, 2, 3, 4, 5))  # fewer blocks than stages: layer counts


def test_moe_spread_calibration():
    import random

    sd = logit_std_for_spread(0.4)
    rng = random.Random(1)
    stats = []
    for _ in range(3000):
        p = _softmax([sd * rng.gauss(0, 1) for _ in range(8)])
        stats.append((max(p) - min(p)) * 8)
    assert sum(stats) / len(stats) == pytest.approx(0.4, rel=0.05)


def test_repack_projection_packs_as_work_shrinks():
    traj = pruning(24)
    start = repack_projection(traj, 8, link=Link(0.0, 1e11), reference="start")
    assert start.ranks[0] == 8 and start.ranks == sorted(start.ranks, reverse=True)  # released GPUs stay released
    assert start.mean_ranks < 8 and start.gpu_hours_saved_fraction == pytest.approx(1 - start.mean_ranks / 8)
    assert all(r >= 1 / 1.05 - 1e-9 for r in start.throughput_ratio)  # within the tolerance of the start
    assert max(start.peak_stage_memory_gb) < 80
    now = repack_projection(traj, 8, link=Link(0.0, 1e11), reference="current")
    assert now.mean_ranks >= start.mean_ranks
    with pytest.raises(ValueError, match="reference"):
        repack_projection(traj, 8, reference="never")


def test_dense_reference_and_frozen_prefix():
    d = dense(24)
    assert len(d) == 1 and d[0].iterations == 10_000
    f = freezing(24, snapshots=3)
    assert f[-1].costs.time_sum(0, 27) < f[0].costs.time_sum(0, 27) == d[0].costs.time_sum(0, 27)


TINY = {"layers": [8], "stages": [2, 4], "headline": {"layers": 8, "stages": 4}, "snapshots": 3,
        "per_iteration_snapshots": 3, "dynamic": ["partition_time", "diffusion_time"], "head_chunks": 2,
        "pipeline_granularity": "sublayer",
        "sensitivity_head_scale": [0.0], "repack": {"stages": 4, "cases": ["pruning"]}}


def test_projection_on_a_tiny_grid(tmp_path):
    s = project(TINY, tmp_path)
    assert s["simulated"] is True and "measured" in s["costs"] and "synthetic" in s["costs"]
    assert set(s["projected_speedup_vs_static"]) == set(CASES)
    for case in CASES:
        assert math.isfinite(s["projected_speedup_vs_static"][case]) and s["projected_speedup_vs_static"][case] > 0.5
        assert 0 <= s["bubble_dynamic"][case] < 1 and 0 <= s["bubble_static"][case] < 1
        # vs Megatron's layout (head on the last stage) is at least the speedup vs the best static
        assert s["speedup_vs_megatron"][case] >= s["projected_speedup_vs_static"][case] - 1e-9
    assert 0 < s["inherent_bubble"] < 1
    assert s["packing"]["pruning"]["8"]["stages"] == 4 and s["packing"]["pruning"]["8"]["mean_gpus"] <= 4
    assert set(s["sensitivity_head_scale"]["0.0"]) == set(CASES)
    # 2 stage counts x 2 granularities at 1F1B, + the headline cell under 2 zero-bubble schedules x 2 granularities
    assert len(s["cells"]) == len(CASES) * (2 * 2 + 2 * 2)
    assert s["granularity"] == "sublayer" and s["head_chunks"] == 2 and s["pipeline_layers"] == 2 * 8 + 2 + 2
    assert set(s["granularities"]) == {"sublayer", "block"} and set(s["schedules"]) == {"zbv", "zero_bubble"}
    assert s["granularities"]["block"]["pipeline_layers"] == 8 + 3
    for figs in [*s["granularities"].values(), *(f for d in s["schedules"].values() for f in d.values())]:
        assert 0 < figs["dense_efficiency"] <= 1
        for case in CASES:  # nothing beats every rank holding exactly its share (links and all-reduce free)
            assert figs["projected_speedup_vs_static"][case] <= figs["fluid_ceiling"][case] * (1 + 1e-9)
    assert s["schedules"]["zbv"]["sublayer"]["inherent_bubble"] < s["inherent_bubble"]  # zero bubble: smaller
    for case, q in s["stage_max_over_mean"].items():  # the exact split is never worse than equal piece counts
        assert 1.0 <= q["partition_time"] <= q["uniform"] * (1 + 1e-12)
    assert set(s["speedup_vs_block_static"]) == set(CASES)
    assert "speedup_vs_block_static" not in s["granularities"]["block"]
    report = (tmp_path / "report.md").read_text()
    assert "simulated" in report.lower() and "| moe |" in report and "paper_scale.png" in report
    assert (tmp_path / "paper_scale.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"]["projected_speedup_vs_static"] == s["projected_speedup_vs_static"]


def test_config_checks_and_links():
    with pytest.raises(ValueError, match="unknown paper_scale keys"):
        merged({"stagez": [4]})
    with pytest.raises(ValueError, match="unknown cases"):
        merged({"cases": ["nope"]})
    with pytest.raises(ValueError, match="granularity"):
        merged({"pipeline_granularity": "layer"})
    with pytest.raises(ValueError, match="head_chunks"):
        merged({"head_chunks": 0})
    q = merged({"quick": True})
    assert q["layers"] == [48] and q["stages"] == [8, 24] and len(q["dynamic"]) == 2
    net = DEFAULTS["network"]
    ls = links(8, net)
    assert [x.bandwidth for x in ls] == [3.6e11] * 3 + [4.5e10] + [3.6e11] * 3 + [4.5e10]


def test_recipe_help_and_config():
    out = subprocess.run([sys.executable, str(REPO / "recipes" / "paper_scale.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(word in out.stdout for word in ("MEASURED", "SYNTHETIC", "quick=true", "headline"))
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "paper_scale.yaml"))
    cfg.pop("defaults"), cfg.pop("hydra")
    assert set(cfg) == set(DEFAULTS) and merged(cfg)["cases"] == list(CASES)


def test_slow_changes_are_balanced_after_one_profiled_step():
    """A snapshot lasting many iterations is balanced on its own costs (after one profiled step on
    the old partition); one-iteration snapshots (per-step routing) on the previous one's."""
    from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
    from lightning_dynmo.plan.cost_model import CostModel, LayerCosts
    from lightning_dynmo.sim.scenarios import compare

    model = CostModel(16)
    traj = freezing(24, Profile.from_flops(), snapshots=3)
    c = compare(traj, 4, dynamic=("partition_time",))
    for snap, shown in zip(traj, c.partitions["partition_time"]):
        part = Partition((0, *(int(r.split("-")[1]) + 1 for r in shown.split("|"))))
        best = get_balancer("partition_time")(BalanceProblem(snap.costs, 4, model)).max_load
        assert max(model.stage_times(snap.costs, part)) == best
    heavy_first = LayerCosts([4.0] + [1.0] * 7, [0.0] * 8, [1] * 8, [0.0] * 8, [0.0] * 8)
    heavy_last = LayerCosts([1.0] * 7 + [4.0], [0.0] * 8, [1] * 8, [0.0] * 8, [0.0] * 8)
    lagged = compare([heavy_first, heavy_last], 2, dynamic=("partition_time",), static=("uniform",))
    assert lagged.partitions["partition_time"][1] == lagged.partitions["partition_time"][0]  # known one step late


def test_static_time_is_the_first_snapshots_time_balanced_split():
    """``static_time``: partition_time on the first snapshot, kept for the whole trajectory; a
    balancer cannot be both static and dynamic."""
    from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
    from lightning_dynmo.sim.scenarios import STATIC, compare, freezing
    from lightning_dynmo.sim.simulate import matching_cost_model

    assert "static_time" in STATIC
    traj = freezing(8, snapshots=4, granularity="fine", head_chunks=2)
    c = compare(traj, 4, "1f1b", 16, static=["uniform", "static_time"], dynamic=["partition_time"])
    first = get_balancer("partition_time")(BalanceProblem(traj[0].costs, 4, matching_cost_model("1f1b", 16))).partition
    assert set(c.partitions["static_time"]) == {str(first)}
    assert c.partitions["partition_time"][0] == str(first) and len(set(c.partitions["partition_time"])) > 1
    # equal piece counts are far from balanced on fine pieces; the time-balanced static split is not
    assert c.step_time["static_time"] < c.step_time["uniform"] and c.best_static == "static_time"
    with pytest.raises(ValueError, match="static or dynamic"):
        compare(traj, 4, "1f1b", 16, static=["partition_time"], dynamic=["partition_time"])


def test_fine_granularity_layouts():
    from lightning_dynmo.sim.scenarios.projection import layouts

    lays = layouts(merged({"pipeline_granularity": "fine", "head_chunks": 4}))
    assert list(lays) == ["fine", "sublayer", "block"] and lays["fine"]["head_chunks"] == 4
    assert lays["block"]["head_chunks"] == 1
    assert list(layouts(merged({"pipeline_granularity": "block"}))) == ["block"]
    assert list(layouts(merged({"pipeline_granularity": "fine", "compare_block": False}))) == ["fine"]
