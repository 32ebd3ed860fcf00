"""Bad input fails early with a message that names the fix, on every rank, never a hang."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest


from tests.support.multiproc import ROOT, worker_env

WORKER = ROOT / "tests" / "support" / "workers" / "bad_input_worker.py"


def _run(case: str, timeout: int = 120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(WORKER), case]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    return proc, time.time() - t0


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,message",
    [
        ("too_many_stages", "cannot split 5 layers into 6 pipeline stages"),
        ("batch_not_divisible", "batch size 6 is not divisible by microbatches=4"),
        ("no_protocol", "does not define pipeline_layers and pipeline_loss"),
    ],
)
def test_bad_input_fails_on_every_rank(case, message):
    proc, _ = _run(case)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):  # each rank raises the same error itself, before any collective
        assert any(message in line for line in out.splitlines() if line.startswith(f"[rank{rank}]")), out[-3000:]


@pytest.mark.slow
def test_a_dead_rank_makes_the_others_fail_not_hang():
    proc, seconds = _run("die")
    assert proc.returncode != 0
    assert seconds < 90


@pytest.mark.slow
def test_a_stuck_rank_times_out_with_a_message():
    proc, seconds = _run("stall")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert seconds < 90  # the collective timeout is 8 s
    assert "rank0" in out and ("Timed out" in out or "timeout" in out.lower()), out[-3000:]
