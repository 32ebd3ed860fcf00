"""The failure board's attribution without a job: a single-process store stands in for the
job's c10d store (the multi-process behaviour is tests/distributed/test_bad_input.py and
test_fault.py)."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from lightning_dynmo.runtime import fault
from lightning_dynmo.runtime.fault import FailureBoard, diagnose, step_region, where_is_main


@pytest.fixture
def board(monkeypatch):
    b = FailureBoard(dist.HashStore(), rank=0, world_size=3)
    monkeypatch.setattr(fault._job, "board", b)
    monkeypatch.setattr(fault._job, "epoch", 0)
    monkeypatch.setattr(fault._job, "pending", None)
    monkeypatch.setattr(fault._job, "failed", None)
    return b


def test_a_timeout_goes_beside_the_failures_not_into_them(board):
    """A stalled peer must not read "rank 0 failed": the rank that timed out is not the cause."""
    board.publish_lost(0, "training step 3", RuntimeError("Timed out waiting 10000ms for send"))
    assert board.first(0) is None and board.lost(0).rank == 0 and board.anything(0)
    assert board.all_failed(0, wait=0.0) is False  # one of three ranks counted


def test_diagnose_names_the_running_rank_the_silent_one_and_the_waiting_one():
    answers = {1: {"region": "training step 3", "seconds": 12.0, "collective": False, "failed": False,
                   "at": "model.py:42 in forward"},
               3: {"region": "training step 3", "seconds": 12.0, "collective": True, "failed": False, "at": "x"},
               4: {"failed": True, "lost": True, "region": "training step 3"}}
    text = diagnose(0, 5, answers)
    assert "rank 1 is running in training step 3 for 12.0 s, not waiting in a collective, at model.py:42 in forward: " \
           "the job stalled there" in text
    assert "rank(s) 2 did not answer: the process is gone" in text
    assert "rank(s) 3 are waiting in a collective too" in text
    assert "rank(s) 4 timed out or lost a peer too" in text  # alive: not among the silent ones
    outside = diagnose(1, 2, {0: {"region": None, "collective": False, "at": "cb.py:7 in on_train_batch_start"}})
    assert "rank 0 is running outside the pipeline step (a hook, callback or data loading)" in outside


def test_where_is_main_reports_the_region_and_the_callers_frame(board):
    """Asked from another thread (the watchdog's), while the main thread runs in a step."""
    seen = []
    asker = threading.Thread(target=lambda: (time.sleep(0.3), seen.append(where_is_main())))  # once main is in its loop
    with step_region("optimizer step 4"), step_region("training step 4"):
        asker.start()
        while not seen:  # running code, not waiting in a collective
            pass
    asker.join()
    (status,) = seen
    assert status["region"] == "training step 4" and not status["collective"] and not status["failed"]
    assert "test_fault_board.py" in status["at"] and "test_where_is_main" in status["at"]


def test_a_sys_exit_in_a_step_is_this_ranks_failure_named_in_that_step(board):
    """It used to reach the peers as "outside the pipeline step (a hook or callback)"."""
    with pytest.raises(SystemExit), step_region("optimizer step 3"), step_region("training step 3"):
        raise SystemExit(5)
    first = board.first(0)
    assert (first.rank, first.where, first.error) == (0, "training step 3", "SystemExit: 5")
    assert board.store.add("dynmo/failure/0/count", 0) == 1  # counted once, not once per region


def test_lightnings_sigterm_stop_is_not_a_failure(board):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    with pytest.raises(SIGTERMException), step_region("step 3 (batch 3)"):
        raise SIGTERMException()
    assert board.first(0) is None and not board.anything(0)
