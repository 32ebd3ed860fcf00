"""The collective ledger: ranks agree on the name and count of their next collective call in one
all-reduce, carry flags along, and every rank raises, naming every rank's call, when they differ.
Two or three gloo ranks forked from the test process (no torchrun); the strategy's use of it across
a real job is in tests/distributed/test_fault.py and test_bad_input.py."""
from __future__ import annotations

import pytest
import torch

from lightning_dynmo.runtime import fault
from lightning_dynmo.runtime.ledger import CollectiveLedger

from tests.support.worlds import forked_ranks

CPU = torch.device("cpu")


def _agree_in_turn(calls_of_rank):
    """A rank function making ``calls_of_rank(rank)``'s ``(name, flag)`` agreements in turn."""
    def run(rank, world):
        ledger = CollectiveLedger(rank, CPU)
        return [ledger.agree(name, flag=flag) for name, flag in calls_of_rank(rank)], ledger.count
    return run


def _ok(results):
    assert all(kind == "ok" for kind, _ in results), results
    return [value for _, value in results]


def test_agreeing_ranks_get_the_largest_flags(tmp_path):
    calls = lambda r: [("save", float(r)), ("barrier", (2.0 - r, float(r))), ("step", 0.0)]  # noqa: E731
    out = _ok(forked_ranks(_agree_in_turn(calls), 3, tmp_path))
    assert [answers for answers, _ in out] == [[2.0, (2.0, 2.0), 0.0]] * 3
    assert [count for _, count in out] == [3] * 3


def test_different_calls_raise_on_every_rank_naming_each(tmp_path):
    calls = lambda r: [("save", 0.0), ("broadcast" if r else "save", 0.0)]  # noqa: E731
    out = forked_ranks(_agree_in_turn(calls), 2, tmp_path)
    assert [kind for kind, _ in out] == ["raised", "raised"], out
    for name, message, _ in (value for _, value in out):
        assert name == fault.CollectiveMismatchError.__name__
        assert "rank 0: save#2; rank 1: broadcast#2" in message
        assert "on every rank" in message  # the fix


def test_a_call_with_fewer_flags_meets_the_others_and_sees_the_mismatch(tmp_path):
    """One all-reduce size for every call: a rank agreeing with one flag must not hang in an
    all-reduce of another size than its peer's two-flag one."""
    out = forked_ranks(_agree_in_turn(lambda r: [("a", (1.0, 2.0))] if r else [("b", 1.0)]), 2, tmp_path, 30)
    assert [value[0] for _, value in out] == [fault.CollectiveMismatchError.__name__] * 2, out


def test_one_rank_agrees_without_communicating(world_of_one):
    ledger = CollectiveLedger(0, CPU)
    assert ledger.agree("save", flag=3.0) == 3.0
    assert ledger.agree("save", flag=(1.0, 2.0)) == (1.0, 2.0)
    assert ledger.count == 0


def test_too_many_flags_are_refused_on_any_world(world_of_one):
    with pytest.raises(ValueError, match="at most 2 flags"):
        CollectiveLedger(0, CPU).agree("save", flag=(1.0, 2.0, 3.0))


def test_a_rank_whose_job_failed_refuses_the_call(world_of_one, monkeypatch):
    job = fault._JobState()
    job.failed = fault.Failure(1, "training_step", "RuntimeError: boom")
    monkeypatch.setattr(fault, "_job", job)
    with pytest.raises(fault.RankFailedError, match="rank 1 failed in training_step.*'save'"):
        CollectiveLedger(0, CPU).agree("save")
