"""The Hydra GPT recipe (recipes/train_gpt.py) end to end, in subprocesses like a user runs it."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.multiproc import user_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipes" / "train_gpt.py"

# tiny everything: 3 steps, one validation at the end, a couple of seconds of compute
TINY = [
    "model=tiny",
    "data.block_size=32",
    "data.batch_size=8",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "checkpoint.every_n_train_steps=3",
]


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        env=user_env(HYDRA_FULL_ERROR="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check_run_dir(run_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary_path = run_dir / "summary.json"
    assert summary_path.is_file(), out[-6000:]
    s = json.loads(summary_path.read_text())
    for key in ("train_loss", "val_loss", "val_ppl", "tokens_per_sec_mean"):
        assert s[key] is not None and math.isfinite(s[key]), (key, s)
    assert 0 < s["train_loss"] < 10 and 0 < s["val_loss"] < 10
    assert s["val_ppl"] == pytest.approx(math.exp(s["val_loss"]), rel=1e-3)
    assert s["tokens_per_sec_mean"] > 0
    assert s["steps"] == 3
    assert out.count("train_gpt summary:") == 1  # printed by global rank 0 only
    metrics = run_dir / "logs" / "csv" / "metrics.csv"
    assert metrics.is_file()
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("train_loss") for r in rows) and any(r.get("val_loss") for r in rows)
    return s


@pytest.mark.slow
def test_pipeline_recipe_two_cpu_ranks(tmp_path):
    """pp=2 over 2 CPU processes (Lightning re-runs the script for rank 1), launched from another cwd."""
    run_dir = tmp_path / "run"
    proc = _run(
        [*TINY, "strategy=dynmo", "strategy.pipeline_parallel=2", "trainer.devices=2", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        timeout=120,
    )
    s = _check_run_dir(run_dir, proc)
    assert s["strategy"] == "DynMoStrategy" and s["pipeline_parallel"] == 2 and s["world_size"] == 2
    assert s["partition"] and len(s["partition_boundaries"]) == 3
    assert s["partition_boundaries"][-1] == 4 + 3  # tiny: embedding + 4 blocks + norm + head
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "train_ddp_process_1.log").is_file()  # rank 1 shared the run dir
    assert not (tmp_path / "outputs").exists()  # no stray run dirs from the child rank
    # the sanity check users read: DynMo's measured overhead, and the gain of each applied decision
    d = s["dynmo"]
    assert d["train_s"] > 0 and 0 <= d["overhead_s"] and s["dynmo_overhead_fraction"] == d["overhead_fraction"]
    assert set(d["overhead_s_by_source"]) == {"profiling", "decision", "counters"}
    assert all({"step", "step_ms_before", "cost_ms"} <= set(p) for p in d["applied_decisions"])
    assert "dynmo cost" in proc.stdout + proc.stderr and "dynmo: overhead" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_single_process_baseline(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run([*TINY, "strategy=single", "logger=both", f"hydra.run.dir={run_dir}"], cwd=REPO, timeout=90)
    s = _check_run_dir(run_dir, proc)
    assert s["world_size"] == 1 and s["partition"] is None and s["dynmo"] is None
    assert (run_dir / "logs" / "tensorboard").is_dir()


def test_help_lists_groups_and_overrides(tmp_path):
    proc = _run(["--help"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for needle in (
        "model: gpt2, gpt2_medium, hf, small_cpu, tiny",
        "strategy: dynmo, single",
        "trainer: cpu, gpu",
        "data: pydoc, text",
        "strategy.pipeline_parallel=2",
        "strategy.schedule=interleaved_1f1b",
        "trainer.max_steps=100",
        "data.path=my.txt",
        "strategy=single",
        "_target_: lightning_dynmo.DynMoStrategy",
    ):
        assert needle in text, needle


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.preset=huge", "unknown GPT preset 'huge'"),
        ("strategy.schedule=nope", "unknown schedule 'nope'"),
        ("data.batch_size=6", "not divisible by strategy.microbatches=4"),
        ("data=text", "data=text needs a file or folder"),
    ],
)
def test_bad_config_fails_before_training(tmp_path, override, message):
    run_dir = tmp_path / "run"
    proc = _run(["model=tiny", override, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "Initializing distributed" not in proc.stderr + proc.stdout  # no rank was launched
    assert not (run_dir / "summary.json").exists()
