"""Bad input fails early with a message that names the fix, on every rank, never a hang."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.protocol import PipelineProtocolError, pipeline_layers_of

sys.path.insert(0, str(Path(__file__).parent))
from multiproc import ROOT, worker_env  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "bad_input_worker.py"


def test_unknown_schedule_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*1f1b.*gpipe.*interleaved_1f1b"):
        DynMoStrategy(schedule="pipedream")


def test_unknown_balancer_lists_valid_ones():
    with pytest.raises(ValueError, match="diffusion_time.*partition_time.*uniform"):
        DynMoStrategy(balancer="magic")


def test_1f1b_with_fewer_microbatches_than_stages():
    with pytest.raises(ValueError, match="at least as many micro-batches as pipeline ranks.*microbatches=2 < pipeline_parallel=4"):
        DynMoStrategy(pipeline_parallel=4, schedule="1f1b", microbatches=2)
    DynMoStrategy(pipeline_parallel=4, schedule="gpipe", microbatches=2)  # GPipe has no such limit


@pytest.mark.parametrize("kw", [{"pipeline_parallel": 0}, {"microbatches": -1}, {"rebalance": "sometimes"},
                                {"rebalance_interval": 0}, {"memory_capacity": -5}, {"virtual_stages": 2},
                                {"timeout": 0}, {"repack": "sometimes"}, {"repack_tolerance": 2.0}])
def test_nonsense_options_are_rejected(kw):
    with pytest.raises(ValueError):
        DynMoStrategy(**kw)


def test_devices_not_divisible_by_pipeline_parallel_fails_before_launch():
    with pytest.raises(ValueError, match="multiple of pipeline_parallel"):
        L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2), accelerator="cpu", devices=3)


def test_module_without_protocol_names_what_is_missing():
    class Plain(L.LightningModule):
        pass

    with pytest.raises(PipelineProtocolError, match="does not define pipeline_layers and pipeline_loss"):
        pipeline_layers_of(Plain())


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
