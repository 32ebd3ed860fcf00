"""A cluster's signals in the middle of a pipeline step (``strategy/signals.py``): SLURM's requeue
signal saves a checkpoint on every rank and requeues the job once; SIGTERM stops every rank
together within seconds; the requeued job resumes on the uninterrupted run's curve.

Before: SIGTERM inside a step hung both ranks for the whole collective timeout (Lightning's
handler broadcasts while the peer waits in a receive), and the requeue signal failed every rank
with ``CollectiveMismatchError`` (the checkpoint's collectives met the peer's step), nothing saved.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import multiproc
from tests.support.multiproc import ROOT, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.compat]  # compat: also on the lowest torch (CI)
WORKER = ROOT / "tests" / "support" / "workers" / "signal_worker.py"
FAST = 30.0  # seconds: a stop at the next batch boundary, far below the worker's 60 s collective timeout


def launch(out: Path, case: str) -> tuple[dict[int, dict], float, str]:
    """One 2-rank job; ``scontrol`` on its PATH records its arguments in ``out/scontrol.log``."""
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    for r in (0, 1):
        (out / f"rank{r}.json").unlink(missing_ok=True)
    env = worker_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(WORKER), case, str(out)]
    t0 = time.monotonic()
    if case == "uninterrupted":  # no signal, no scontrol: the reference curve, on the warm launcher
        proc = multiproc.launch(cmd, timeout=300)
    else:  # signals stay on the command line (fresh interpreters, as a cluster starts them)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    log = proc.stdout + "\n" + proc.stderr
    (out / f"{case}.log").write_text(log)
    outcomes = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").is_file()}
    assert set(outcomes) == {0, 1}, log[-4000:]
    return outcomes, took, log


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[list[float]]:
    outcomes, _, log = launch(tmp_path_factory.mktemp("uninterrupted"), "uninterrupted")
    assert outcomes[0]["error"] is None and outcomes[1]["error"] is None, log[-4000:]
    return outcomes[0]["losses"]


def test_requeue_signal_saves_once_and_sigterm_stops_every_rank_then_the_requeued_job_resumes(
        tmp_path, uninterrupted):
    outcomes, took, log = launch(tmp_path, "preempted")
    for rank in (0, 1):
        o = outcomes[rank]
        assert o["error"] == "SIGTERMException", (rank, o)
        assert o["global_step"] == 7, (rank, o)  # the step that got the signal finished; no more
        assert o["seconds"] < FAST, (rank, o)
        assert [s for s, _ in o["losses"]] == list(range(1, 8))
        assert [l for _, l in o["losses"]] == pytest.approx([l for _, l in uninterrupted[:7]], rel=1e-6)
    # one checkpoint saved by every rank at the boundary after step 3, one requeue (by rank 0)
    assert sorted(p.name for p in (tmp_path / "job").glob("hpc_ckpt_*.ckpt")) == ["hpc_ckpt_1.ckpt"], log[-4000:]
    ckpt = torch.load(tmp_path / "job" / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 4242"]

    outcomes, _, log = launch(tmp_path, "requeued")
    assert "Restored all states from the checkpoint at" in log and "hpc_ckpt_1.ckpt" in log, log[-4000:]
    for rank in (0, 1):
        o = outcomes[rank]
        assert o["error"] is None, (rank, o)
        assert [s for s, _ in o["losses"]] == list(range(5, 13))  # from the checkpoint's step on
        # the same state as the uninterrupted run at step 4 (weights, Adam, LR schedule) on the same batch
        assert [l for _, l in o["losses"]] == pytest.approx([l for _, l in uninterrupted[4:]], rel=1e-5)


def test_sigterm_on_one_rank_stops_both_at_the_same_step(tmp_path, uninterrupted):
    outcomes, took, log = launch(tmp_path, "sigterm_on_rank_1")
    for rank in (0, 1):
        o = outcomes[rank]
        assert o["error"] == "SIGTERMException", (rank, o)
        assert o["global_step"] == 4 and o["seconds"] < FAST, (rank, o)
    assert not (tmp_path / "scontrol.log").exists()


def test_signals_in_the_final_validation_are_acted_on_after_the_current_batch(tmp_path):
    """The requeue signal in the final validation's batch 1 saves (inside the validation) and
    requeues; SIGTERM on one rank in its batch 2 stops both ranks after that batch. Before, no
    training batch followed, so neither was acted on: nothing saved, the validation ran to its end."""
    outcomes, took, log = launch(tmp_path, "in_final_validation")
    for rank in (0, 1):
        o = outcomes[rank]
        assert o["error"] == "SIGTERMException", (rank, o)
        assert o["global_step"] == 6 and o["seconds"] < 2 * FAST, (rank, o)
        assert o["val_batches"] == [[3, 0], [3, 1], [3, 2], [3, 3], [6, 0], [6, 1]], (rank, o)
    assert sorted(p.name for p in (tmp_path / "job").glob("hpc_ckpt_*.ckpt")) == ["hpc_ckpt_1.ckpt"], log[-4000:]
    ckpt = torch.load(tmp_path / "job" / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 6 and ckpt["saved_in"] == "validation"
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 4242"]
