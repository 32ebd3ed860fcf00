"""Failures and divergence that name themselves instead of hanging (issue 31).

A pipeline rank that raises inside a step leaves its peers blocked in a send or receive that will
never complete; gloo cannot abort such a wait from Python (neither ``abort()`` nor ``shutdown()``
of the group releases it: only the peer's sockets closing does). Three parts keep that from
becoming a silent wait of the whole collective timeout:

* :class:`FailureBoard` - a rank whose step raised an error of its own (not one that every rank
  raised together, see :func:`raised_on_every_rank`) writes ``rank, where, error`` to the job's
  c10d store before re-raising, and the job is *failed* in that process: every later DynMo
  collective raises :class:`RankFailedError` at once instead of pairing with a peer that is
  elsewhere. A peer whose own collective then fails (its partner closed the connection, or a
  timeout) reads the board and raises :class:`RankFailedError` naming the rank and its error.
* :class:`FailureWatchdog` - a daemon thread per process polls the board. When another rank
  failed and this rank is still inside a step ``grace`` seconds later (blocked on the failed
  rank), it prints the failure and every thread's Python stack and exits the process with code 1,
  the way NCCL's async error handling tears down a process whose peer is gone.
* :class:`CollectiveLedger` - before each DynMo collective whose participation depends on
  state, the ranks agree on the call's name and a counter in one small all-reduce. A rank that
  makes a call the others do not (a ``broadcast`` on one rank only, a decision only some ranks
  reach) meets its peers in the same all-reduce, so every rank raises
  :class:`CollectiveMismatchError` within one round trip, naming every rank's call and the fix.

On a collective timeout every rank dumps its Python stacks (``faulthandler``) to stderr before
raising, so the call it was stuck in shows without a debugger.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

BOARD_KEY = "dynmo/failure"
#: seconds a rank may stay blocked after a peer failed before the watchdog stops it
STUCK_GRACE_SECONDS = float(os.environ.get("DYNMO_FAILURE_GRACE", "5"))
_POLL_SECONDS = 0.25


class RankFailedError(RuntimeError):
    """Another rank of the job failed; this rank cannot go on (its collectives would wait for it)."""

    raised_on_every_rank = True


class CollectiveMismatchError(RuntimeError):
    """The ranks were about to make different collective calls."""

    raised_on_every_rank = True


def raised_on_every_rank(err: BaseException) -> bool:
    """Whether ``err`` was raised by every rank together, after a collective that told them all
    (a protocol problem gathered from the stages, a non-finite loss, a batch mismatch): such an
    error leaves no peer waiting. Set as a class attribute, or on one instance with :func:`agreed`."""
    return bool(getattr(err, "raised_on_every_rank", False))


def agreed(err: BaseException) -> BaseException:
    """Mark ``err`` as raised on every rank (see :func:`raised_on_every_rank`); returns it."""
    err.raised_on_every_rank = True
    return err


def peer_missing(err: BaseException) -> bool:
    """A collective that timed out, or whose peer closed its connection or aborted."""
    text = str(err).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed", "connection reset",
                                   "broken pipe", "pair closure", "aborted"))


def explain_lost_peer(err: BaseException, where: str, hint: str) -> BaseException:
    """What to raise for a collective error ``err`` in ``where``: :class:`RankFailedError` when the
    board names a rank that failed, else ``err``'s text followed by ``hint``, after dumping this
    rank's stacks (a timeout with no failure on the board: the ranks made different calls)."""
    origin = _job.board.first(wait=2.0) if _job.board is not None else None
    rank = _job.board.rank if _job.board is not None else dist.get_rank() if dist.is_initialized() else 0
    if origin is not None and origin.rank != rank:
        _job.failed = origin
        return RankFailedError(f"rank {rank} stopped in {where}: {origin.describe()}")
    dump_stacks(f"dynmo: rank {rank} lost a peer or timed out in {where}; its stacks:")
    explained = RuntimeError(f"{err}\n{hint}")
    explained.stacks_dumped = True
    return explained


def dump_stacks(header: str) -> None:
    """Every thread's Python stack to stderr, after ``header`` (where this rank was stuck)."""
    print(f"\n{header}\n", file=sys.stderr, flush=True)
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (ValueError, OSError):  # stderr without a file descriptor (a notebook)
        import traceback

        for tid, frame in sys._current_frames().items():
            print(f"Thread {tid}:\n{''.join(traceback.format_stack(frame))}", file=sys.stderr)
    sys.stderr.flush()


def describe_error(err: BaseException) -> str:
    """``err`` by its root cause: torch's schedules re-raise a stage's error as "[Stage 1] failed
    to run forward", whose ``__cause__`` holds what the layer raised."""
    chain = [err]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    text = lambda e: f"{type(e).__name__}: {' '.join(str(e).split())}"  # noqa: E731 - one line each
    root = text(chain[-1])
    return root if len(chain) == 1 else f"{root} (raised as {text(chain[0])[:200]})"


@dataclass(frozen=True)
class Failure:
    rank: int
    where: str
    error: str

    def describe(self) -> str:
        return f"rank {self.rank} failed in {self.where}: {self.error}"


class FailureBoard:
    """The job's first failure, in its c10d store (the first rank to write wins)."""

    def __init__(self, store, rank: int) -> None:
        self.store = store
        self.rank = rank

    def publish(self, where: str, err: BaseException) -> Failure:
        failure = Failure(self.rank, where, describe_error(err))
        payload = json.dumps(failure.__dict__)
        try:
            self.store.compare_set(BOARD_KEY, "", payload)
        except Exception:  # noqa: BLE001 - the store is gone: the error still propagates locally
            pass
        return failure

    def first(self, wait: float = 0.0) -> Failure | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.store.check([BOARD_KEY]):
                    return Failure(**json.loads(self.store.get(BOARD_KEY).decode()))
            except Exception:  # noqa: BLE001 - a store that is gone holds no failure we can read
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_SECONDS)


class _JobState:
    """Per process: the board, whether the job failed, and the step region the main thread is in."""

    def __init__(self) -> None:
        self.board: FailureBoard | None = None
        self.failed: Failure | None = None
        self.region: str | None = None
        self.region_since = 0.0
        self.watchdog: FailureWatchdog | None = None


_job = _JobState()


def install(rank: int) -> None:
    """Once per process, after the default process group exists: the board and its watchdog."""
    if not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    if _job.board is None or _job.board.store is not store:
        _job.board = FailureBoard(store, rank)
        _job.failed = None
        _job.watchdog = FailureWatchdog(_job)
        _job.watchdog.start()


def job_failure() -> Failure | None:
    """The failure that ended this job in this process (None: none)."""
    return _job.failed


def check_not_failed(what: str) -> None:
    if _job.failed is not None:
        raise RankFailedError(
            f"{_job.failed.describe()}. This process cannot make the collective call {what!r}: its peers "
            "are gone or still waiting for that rank. Fix the cause and start a new job (a process group "
            "cannot be reused after one of its ranks failed in a step)")


@contextmanager
def step_region(where: str):
    """Around a part of a training step in which every rank exchanges tensors with its peers
    (regions nest: an optimizer step's closure runs the training step).

    An error of this rank's own is published (its peers learn who failed and why) and re-raised;
    a lost peer or a timeout becomes :class:`RankFailedError` naming the rank that failed, or, with
    no failure on the board, a dump of every thread's stack before the error propagates."""
    check_not_failed(where)
    outer = _job.region
    if outer is None:
        _job.region, _job.region_since = where, time.monotonic()
    try:
        yield
    except Exception as err:  # noqa: BLE001 - classified and re-raised
        if not getattr(err, "_dynmo_seen", False):
            err._dynmo_seen = True
            _fail(where, err)
        raise
    finally:
        if outer is None:
            _job.region = None


def _fail(where: str, err: BaseException) -> None:
    if raised_on_every_rank(err) or _job.board is None:
        return
    if peer_missing(err):
        origin = _job.board.first(wait=2.0)
        if origin is not None and origin.rank != _job.board.rank:
            _job.failed = origin
            raise RankFailedError(f"rank {_job.board.rank} stopped in {where}: {origin.describe()}") from err
        if not getattr(err, "stacks_dumped", False):
            dump_stacks(f"dynmo: rank {_job.board.rank} lost a peer or timed out in {where}; its stacks:")
        return
    _job.failed = _job.board.publish(where, err)


class FailureWatchdog(threading.Thread):
    """Stops this process when another rank failed while this one is blocked in a step."""

    def __init__(self, job: _JobState) -> None:
        super().__init__(name="dynmo-failure-watchdog", daemon=True)
        self.job = job

    def run(self) -> None:
        board = self.job.board
        while board is self.job.board:
            failure = board.first()
            if failure is None:
                time.sleep(_POLL_SECONDS)
                continue
            if failure.rank == board.rank:
                return
            seen = time.monotonic()
            while time.monotonic() - seen < STUCK_GRACE_SECONDS:
                if self.job.region is None:  # it left the step on its own (it raised, or was done)
                    self.job.failed = self.job.failed or failure
                    return
                time.sleep(_POLL_SECONDS)
            dump_stacks(f"dynmo: rank {board.rank} stops: {failure.describe()}\nrank {board.rank} was blocked "
                        f"in {self.job.region} for {time.monotonic() - self.job.region_since:.1f} s, waiting for "
                        "that rank; its stacks:")
            os._exit(1)


class CollectiveLedger:
    """Agreement on the next collective call (name and counter) before it is made."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.count = 0

    def agree(self, name: str, group=None) -> None:
        """Collective over ``group`` (default: the world): every rank names the call it is about to
        make; if the names or counters differ, every rank raises :class:`CollectiveMismatchError`."""
        check_not_failed(name)
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        self.count += 1
        call = f"{name}#{self.count}"
        h = float(zlib.crc32(call.encode()))
        v = torch.tensor([h, -h], dtype=torch.float64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MIN, group=group)
        if v[0].item() == -v[1].item():
            return
        calls: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(calls, (self.rank, call), group=group)
        listing = "; ".join(f"rank {r}: {c}" for r, c in calls)
        raise CollectiveMismatchError(
            f"the ranks are about to make different collective calls ({listing}). Every rank must make the "
            "same DynMo/Lightning collective calls in the same order: call trainer.save_checkpoint, "
            "strategy.broadcast/barrier, trainer.log_dir and strategy.rebalance_to / repack_to / "
            "gather_layer_costs on every rank (not under `if trainer.is_global_zero:`), and keep rank-local "
            "state (a timer, a file, the torch version) out of decisions about which calls to make")
