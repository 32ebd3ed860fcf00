"""Issue 31: a rank that fails or diverges names itself within seconds, never a silent wait of
the collective timeout (120 s in these launches).

Each case is one 2-rank torchrun job of ``fault_worker.py`` (on the warm launcher: its ranks raise
and stop themselves, none is killed from outside); every rank writes its own outcome.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import multiproc
from tests.support.multiproc import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.compat]  # compat: also on the lowest torch (CI)
WORKER = ROOT / "tests" / "support" / "workers" / "fault_worker.py"
TIMEOUT = 120.0  # the strategy's collective timeout in the worker


def launch(tmp: Path, case: str) -> tuple[multiproc.Finished, dict[int, list[dict]], float]:
    t0 = time.monotonic()
    proc = multiproc.launch(multiproc.torchrun(2, WORKER, case, str(tmp)), timeout=600, log=tmp / "worker.log")
    took = time.monotonic() - t0
    outcomes = {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1) if (tmp / f"rank{r}.json").is_file()}
    return proc, outcomes, took


def test_a_rank_local_extra_collective_is_reported_on_every_rank_within_seconds(tmp_path):
    proc, outcomes, _ = launch(tmp_path, "extra_collective")
    for rank in (0, 1):
        (first,) = outcomes[rank]
        assert first["error"] == "CollectiveMismatchError", first
        assert "rank 0: training step" in first["message"] and "rank 1: broadcast" in first["message"]
        assert "on every rank" in first["message"]  # the fix
        assert first["seconds"] < 20, first  # the whole fit, not the 120 s timeout


def test_an_exception_on_one_rank_ends_the_step_on_every_rank_with_its_cause(tmp_path):
    proc, outcomes, took = launch(tmp_path, "raise_then_exit")
    (failed,) = outcomes[1]
    assert failed["error"] == "RuntimeError" and "[Stage 1] failed to run forward" in failed["message"]
    (peer,) = outcomes[0]
    assert peer["error"] == "RankFailedError", peer
    assert "rank 1 failed in training step 2" in peer["message"]
    assert "boom: a layer failed on rank 1 only" in peer["message"]  # the root cause, not torch's wrapper
    assert peer["seconds"] < 30, peer


def test_a_failed_rank_that_lives_on_neither_hangs_nor_leaves_its_peer_waiting(tmp_path):
    """The benchmark harnesses' pattern: catch the failure, go on to the next Trainer. The failed
    rank's next collective refuses at once; its blocked peer is stopped by the watchdog after the
    grace period with the cause and its stack, long before the collective timeout."""
    proc, outcomes, took = launch(tmp_path, "raise_then_continue")
    first, second = outcomes[1]
    assert second["error"] == "RankFailedError" and second["seconds"] < 15, second  # the grace, not the timeout
    assert "cannot make the collective call 'setup with torch" in second["message"]
    log = (tmp_path / "worker.log").read_text()
    assert "dynmo: rank 0 stops: rank 1 failed in training step 2" in log
    assert "boom: a layer failed on rank 1 only" in log
    assert "Stack (most recent call first)" in log or "most recent call first" in log  # faulthandler's dump
    assert 0 not in outcomes and proc.returncode != 0  # rank 0 was stopped, not left waiting
    assert took < TIMEOUT, took

