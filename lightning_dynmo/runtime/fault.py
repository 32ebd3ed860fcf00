"""Failures and divergence that name themselves instead of hanging.

A pipeline rank that raises inside a step leaves its peers blocked in a send or receive that will
never complete; gloo cannot abort such a wait from Python (neither ``abort()`` nor ``shutdown()``
of the group releases it: only the peer's sockets closing does). Two parts keep that from
becoming a silent wait of the whole collective timeout (a third, the agreement on each
collective call before it is made, is ``runtime/ledger.py``):

* :class:`FailureBoard` - every rank whose step raised writes to the job's c10d store: the first
  failure (rank, where, root cause) and a count of failed ranks, per *failure epoch*. A peer whose
  own collective then fails (its partner closed the connection, or a timeout) reads the board and
  raises :class:`RankFailedError` naming the rank and its error. Before its next collective a rank
  that failed waits (``grace`` seconds at most) for the count to reach the world size: an error
  that every rank raised (a bad batch size, a non-finite loss) leaves no one waiting, so the
  epoch closes and the process may fit again; otherwise some peer is still blocked, and this
  process refuses every later DynMo collective with :class:`RankFailedError` instead of pairing
  with a peer that is elsewhere.
* :class:`FailureWatchdog` - a daemon thread per process polls the board. When another rank
  failed and this rank is still inside a step ``grace`` seconds later (blocked on the failed
  rank), it prints the failure and every thread's Python stack and exits the process with code 1,
  the way NCCL's async error handling tears down a process whose peer is gone. When a peer's
  collective timed out with no failure on the board, it answers where this rank's main thread
  is, so the waiting rank can name the rank that stalled (``diagnose``).

On a collective timeout every rank dumps its Python stacks (``faulthandler``) to stderr before
raising, so the call it was stuck in shows without a debugger.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: seconds a rank may stay blocked after a peer failed before the watchdog stops it; also how long
#: a failed rank waits for its peers to report their own failure of the same step
STUCK_GRACE_SECONDS = float(os.environ.get("DYNMO_FAILURE_GRACE", "5"))
_POLL_SECONDS = 0.25
#: how long a rank whose collective timed out waits for the others to say where they are
STATUS_WAIT_SECONDS = 2.0
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DISTRIBUTED_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep


class RankFailedError(RuntimeError):
    """Another rank of the job failed; this rank cannot go on (its collectives would wait for it)."""


class CollectiveMismatchError(RuntimeError):
    """The ranks were about to make different collective calls."""


def peer_missing(err: BaseException) -> bool:
    """A collective that timed out, or whose peer closed its connection or aborted."""
    text = str(err).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed", "connection reset",
                                   "broken pipe", "pair closure", "aborted"))


def describe_error(err: BaseException) -> str:
    """``err`` by its root cause: torch's schedules re-raise a stage's error as "[Stage 1] failed
    to run forward", whose ``__cause__`` holds what the layer raised."""
    chain = [err]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    text = lambda e: f"{type(e).__name__}: {' '.join(str(e).split())}"  # noqa: E731 - one line each
    root = text(chain[-1])
    return root if len(chain) == 1 else f"{root} (raised as {text(chain[0])[:200]})"


def dump_stacks(header: str) -> None:
    """Every thread's Python stack to stderr, after ``header`` (where this rank was stuck)."""
    print(f"\n{header}\n", file=sys.stderr, flush=True)
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (ValueError, OSError, AttributeError):  # stderr without a file descriptor (a notebook)
        import traceback

        for tid, frame in sys._current_frames().items():
            print(f"Thread {tid} (most recent call last):\n{''.join(traceback.format_stack(frame))}", file=sys.stderr)
    sys.stderr.flush()


@dataclass(frozen=True)
class Failure:
    rank: int
    where: str
    error: str

    def describe(self) -> str:
        return f"rank {self.rank} failed in {self.where}: {self.error}"


class FailureBoard:
    """Per failure epoch, in the job's c10d store: the first failure (first writer wins) and how
    many ranks failed."""

    def __init__(self, store, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def publish(self, epoch: int, where: str, err: BaseException) -> Failure:
        return self.put(epoch, "first", Failure(self.rank, where, describe_error(err)))

    def publish_lost(self, epoch: int, where: str, err: BaseException) -> Failure:
        """This rank's collective timed out or lost its peer and no rank reported an error: not a
        root cause, so it goes beside the first failure, not into it (a stalled peer must not be
        told that this rank failed)."""
        return self.put(epoch, "lost", Failure(self.rank, where, describe_error(err)))

    def put(self, epoch: int, key: str, failure: Failure) -> Failure:
        try:
            self.store.compare_set(f"dynmo/failure/{epoch}/{key}", "", json.dumps(failure.__dict__))
            self.store.add(f"dynmo/failure/{epoch}/count", 1)
            self.store.set(f"dynmo/failure/{epoch}/any", "1")
        except Exception:  # noqa: BLE001 - the store is gone: the error still propagates locally
            pass
        return failure

    def anything(self, epoch: int) -> bool | None:
        """Whether any rank published in ``epoch`` (the watchdog's one store call per poll); None
        when the store is gone (its host exited: under Lightning's launcher, rank 0)."""
        try:
            return self.store.check([f"dynmo/failure/{epoch}/any"])
        except Exception:  # noqa: BLE001
            return None

    def first(self, epoch: int, wait: float = 0.0) -> Failure | None:
        return self._read(f"dynmo/failure/{epoch}/first", wait)

    def lost(self, epoch: int) -> Failure | None:
        return self._read(f"dynmo/failure/{epoch}/lost", 0.0)

    def _read(self, key: str, wait: float) -> Failure | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.store.check([key]):
                    return Failure(**json.loads(self.store.get(key).decode()))
            except Exception:  # noqa: BLE001 - a store that is gone holds no failure we can read
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_SECONDS)

    def tell(self, epoch: int, status: dict) -> None:
        """This rank's answer to a peer that timed out: where its main thread is (see ``where_is_main``)."""
        try:
            self.store.set(f"dynmo/failure/{epoch}/status/{self.rank}", json.dumps(status))
        except Exception:  # noqa: BLE001
            pass

    def statuses(self, epoch: int, wait: float) -> dict[int, dict]:
        """The other ranks' answers, waiting up to ``wait`` seconds for all of them (a dead rank,
        or one whose watchdog is gone, never answers)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline, seen = time.monotonic() + wait, {}
        while True:
            for r in others:
                key = f"dynmo/failure/{epoch}/status/{r}"
                try:
                    if r not in seen and self.store.check([key]):
                        seen[r] = json.loads(self.store.get(key).decode())
                except Exception:  # noqa: BLE001
                    return seen
            if len(seen) == len(others) or time.monotonic() >= deadline:
                return seen
            time.sleep(_POLL_SECONDS)

    def all_failed(self, epoch: int, wait: float) -> bool:
        """Whether every rank reported a failure in ``epoch`` (waiting up to ``wait`` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.store.add(f"dynmo/failure/{epoch}/count", 0) >= self.world_size:
                    return True
            except Exception:  # noqa: BLE001
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)


class _JobState:
    """Per process: the board, the failure epoch, this rank's unresolved failure, whether the job
    is over for this process, and the step region the main thread is in."""

    def __init__(self) -> None:
        self.board: FailureBoard | None = None
        self.epoch = 0
        self.pending: Failure | None = None  # this rank failed in ``epoch``; not yet known if alone
        self.failed: Failure | None = None  # some rank failed while others waited: no more collectives
        self.region: str | None = None  # the outermost step region the main thread is in
        self.inner: str | None = None  # and the innermost (an optimizer step's closure runs the training step)
        self.region_since = 0.0
        self.watchdog: FailureWatchdog | None = None
        self.atexit_registered = False


_job = _JobState()


def install(rank: int) -> None:
    """Once per job, after the default process group exists: the board and its watchdog."""
    if not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    if _job.board is None or _job.board.store is not store:
        stop_watchdog()
        _job.board = FailureBoard(store, rank, dist.get_world_size())
        _job.epoch, _job.pending, _job.failed = 0, None, None
        _job.watchdog = FailureWatchdog(_job)
        _job.watchdog.start()
        if not _job.atexit_registered:  # runs before Lightning's process-group teardown (registered earlier)
            atexit.register(stop_watchdog)
            _job.atexit_registered = True


def stop_watchdog() -> None:
    """Stop the watchdog and wait for it: it must not be inside the store when the process group
    (and its store) is torn down at exit."""
    watchdog, _job.watchdog = _job.watchdog, None
    if watchdog is not None and watchdog.is_alive():
        watchdog.stopped.set()
        watchdog.join(timeout=2.0)


def check_not_failed(what: str) -> None:
    """Before a collective: refuse it if this job failed in this process (see the module doc)."""
    job = _job
    if job.failed is None and job.pending is not None:
        if job.board.all_failed(job.epoch, STUCK_GRACE_SECONDS):
            job.epoch, job.pending = job.epoch + 1, None  # every rank raised it: nobody waits
        else:
            job.failed = job.board.first(job.epoch) or job.pending
    if job.failed is not None:
        raise RankFailedError(
            f"{job.failed.describe()}. This process cannot make the collective call {what!r}: its peers "
            "are gone or still waiting for that rank. Fix the cause and start a new job (a process group "
            "cannot be reused after one of its ranks failed alone in a step)")


@contextmanager
def step_region(where: str):
    """Around a part of a training step in which every rank exchanges tensors with its peers
    (regions nest: an optimizer step's closure runs the training step).

    An error is reported on the board and re-raised; a lost peer or a timeout becomes
    :class:`RankFailedError` naming the rank that failed, or, with no failure on the board, naming
    where the other ranks are (the one running code rather than waiting in a collective is where
    the job stalled; one that does not answer is dead), after a dump of every thread's stack."""
    check_not_failed(where)
    outer, inner = _job.region, _job.inner
    if outer is None:
        _job.region, _job.region_since = where, time.monotonic()
    _job.inner = where
    try:
        yield
    except (Exception, SystemExit) as err:  # noqa: BLE001 - reported and re-raised
        if (type(err) is SystemExit or isinstance(err, Exception)) and not getattr(err, "_dynmo_reported", False):
            # (a sys.exit() in a layer is this rank's failure; a SystemExit subclass is not: Lightning's
            # SIGTERMException stops every rank together at a batch boundary)
            err._dynmo_reported = True
            _report(where, err)
        raise
    finally:
        _job.inner = inner
        if outer is None:
            _job.region = None


def _report(where: str, err: BaseException) -> None:
    board = _job.board
    if board is None:
        return
    if not peer_missing(err):
        _job.pending = board.publish(_job.epoch, where, err)
        return
    origin = board.first(_job.epoch, wait=2.0)  # a peer's own error explains the lost connection
    _job.pending = board.publish_lost(_job.epoch, where, err)
    board.tell(_job.epoch, {"failed": True, "lost": True, "region": where})  # for the others' diagnosis
    if origin is not None and origin.rank != board.rank:
        raise _reported(RankFailedError(f"rank {board.rank} stopped in {where}: {origin.describe()}")) from err
    # no rank reported an error: a peer stalled or died. The others' watchdogs answer where they are
    answers = board.statuses(_job.epoch, wait=STATUS_WAIT_SECONDS)
    if not getattr(err, "stacks_dumped", False):
        dump_stacks(f"dynmo: rank {board.rank} lost a peer or timed out in {where}; its stacks:")
    raise _reported(RankFailedError(
        f"rank {board.rank} stopped in {where}: its collective timed out or lost its peer, and no rank reported an "
        f"error. {diagnose(board.rank, board.world_size, answers)}\n{err}")) from err


def _reported(err: BaseException) -> BaseException:
    """``err``, marked as on the board already: an enclosing step region must not count it again
    (a second count would let ``all_failed`` close the epoch while a peer still waits)."""
    err._dynmo_reported = True
    return err


def diagnose(rank: int, world_size: int, answers: dict[int, dict]) -> str:
    """Where each other rank was when ``rank`` lost its peer: the ones running code (not waiting in
    a collective) are where the job stalled; the silent ones are dead or frozen."""
    stalled, waiting, failed, lost, silent = [], [], [], [], []
    for r in range(world_size):
        if r == rank:
            continue
        a = answers.get(r)
        if a is None:
            silent.append(r)
        elif a.get("lost"):
            lost.append(r)
        elif a.get("failed"):
            failed.append(r)
        elif a.get("collective"):
            waiting.append(r)
        else:
            inside = (f"in {a['region']}" if a.get("region")
                      else "outside the pipeline step (a hook, callback or data loading)")
            stalled.append(f"rank {r} is running {inside} for {a.get('seconds', 0.0):.1f} s, not waiting in a "
                           f"collective, at {a.get('at', '?')}")
    parts = []
    if stalled:
        parts.append("; ".join(stalled) + ": the job stalled there (its stacks are on its stderr)")
    if silent:
        parts.append(f"rank(s) {', '.join(map(str, silent))} did not answer: the process is gone (killed, out of "
                     "memory, os._exit) or frozen")
    if lost:
        parts.append(f"rank(s) {', '.join(map(str, lost))} timed out or lost a peer too")
    if waiting:
        parts.append(f"rank(s) {', '.join(map(str, waiting))} are waiting in a collective too")
    if failed:
        parts.append(f"rank(s) {', '.join(map(str, failed))} failed in the same step")
    return ". ".join(parts) + "." if parts else "Every other rank is gone."


def where_is_main() -> dict:
    """The main thread's state as a peer that timed out needs it: the step region, for how long,
    whether it is blocked in a collective (its innermost Python frame is in ``torch.distributed``)
    and the innermost frame outside torch (the user's layer, callback or data loader)."""
    job = _job
    status = {"region": job.inner, "seconds": time.monotonic() - job.region_since if job.region else 0.0,
              "failed": job.pending is not None, "collective": False, "at": "?"}
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is not None:
        status["collective"] = _DISTRIBUTED_DIR in frame.f_code.co_filename
        f = frame
        while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
            f = f.f_back
        f = f or frame
        status["at"] = f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
    return status


def report_failure(where: str, err: BaseException) -> None:
    """Publish an error raised outside a step region (a callback or hook that raised on this rank
    alone), so the peer whose next collective loses this rank names it and the cause instead of
    gloo's "Connection closed by peer". Errors already reported, and those that are themselves a
    peer's failure or a lost peer, are not published again."""
    if _job.board is None or getattr(err, "_dynmo_reported", False):
        return
    if isinstance(err, (RankFailedError, CollectiveMismatchError)) or peer_missing(err):
        return
    err._dynmo_reported = True
    _job.pending = _job.board.publish(_job.epoch, where, err)


def explain_lost_peer(err: BaseException, where: str, hint: str) -> BaseException:
    """What to raise for a collective error ``err`` in ``where``: :class:`RankFailedError` when the
    board names a rank that failed, else ``err``'s text followed by ``hint``, after dumping this
    rank's stacks (a timeout with no failure on the board: the ranks made different calls)."""
    board = _job.board
    origin = board.first(_job.epoch, wait=2.0) if board is not None else None
    rank = board.rank if board is not None else dist.get_rank() if dist.is_initialized() else 0
    if origin is not None and origin.rank != rank:
        return RankFailedError(f"rank {rank} stopped in {where}: {origin.describe()}")
    dump_stacks(f"dynmo: rank {rank} lost a peer or timed out in {where}; its stacks:")
    explained = RuntimeError(f"{err}\n{hint}")
    explained.stacks_dumped = True
    return explained


class FailureWatchdog(threading.Thread):
    """Stops this process when another rank failed while this one is blocked in a step."""

    def __init__(self, job: _JobState) -> None:
        super().__init__(name="dynmo-failure-watchdog", daemon=True)
        self.job = job
        self.board = job.board
        self.stopped = threading.Event()
        self.answered: set[int] = set()  # failure epochs in which this rank told a timed-out peer where it is

    def run(self) -> None:
        job, board = self.job, self.board
        while not self.stopped.wait(_POLL_SECONDS) and dist.is_initialized():
            epoch = job.epoch
            anything = board.anything(epoch)
            if anything is None:
                return  # the store is gone: polling it again only fills stderr with the C++ client's errors
            if not anything:
                continue
            failure = board.first(epoch)
            if failure is None:
                self._answer_lost_peer(epoch)
                continue
            if failure.rank == board.rank or job.pending is not None:
                continue
            seen = time.monotonic()
            while time.monotonic() - seen < STUCK_GRACE_SECONDS and job.region is not None and job.epoch == epoch:
                if self.stopped.wait(_POLL_SECONDS):
                    return
            if job.region is None or job.pending is not None or job.epoch != epoch:
                continue  # it left the step (it raised too, or finished it) or the epoch closed
            dump_stacks(f"dynmo: rank {board.rank} stops: {failure.describe()}\nrank {board.rank} was blocked "
                        f"in {job.region} for {time.monotonic() - job.region_since:.1f} s, waiting for "
                        "that rank; its stacks:")
            os._exit(1)

    def _answer_lost_peer(self, epoch: int) -> None:
        """Another rank's collective timed out or lost its peer with no error on the board: say where
        this rank is; if it is running code rather than waiting in a collective for the whole grace
        period, it is where the job stalled: publish that as the failure, dump its stacks and stop."""
        job, board = self.job, self.board
        lost = board.lost(epoch)
        if lost is None or lost.rank == board.rank or job.pending is not None or epoch in self.answered:
            return
        self.answered.add(epoch)
        status = where_is_main()
        board.tell(epoch, status)
        if status["collective"] or status["failed"]:
            return  # waiting for someone else (its own collective will fail), or it failed itself
        inside = f"in {status['region']}" if status["region"] else "outside the pipeline step"
        # the stacks now: the launcher may stop this process as soon as the peer has raised
        dump_stacks(f"dynmo: rank {lost.rank} timed out or lost its peer in {lost.where} ({lost.error}) while rank "
                    f"{board.rank} has been running {inside} for {status['seconds']:.1f} s at {status['at']}, not "
                    f"waiting in a collective: the job stalled here. Rank {board.rank}'s stacks:")
        seen = time.monotonic()
        while time.monotonic() - seen < STUCK_GRACE_SECONDS:
            if self.stopped.wait(_POLL_SECONDS):
                return
            status = where_is_main()
            if status["collective"] or status["failed"] or job.epoch != epoch:
                return  # it went on to a collective (which will fail), or it failed itself
        board.put(epoch, "first", Failure(
            board.rank, status["region"] or "outside the pipeline step",
            f"stalled: running at {status['at']}, not in a collective, while rank {lost.rank} timed out waiting"))
        print(f"dynmo: rank {board.rank} stops: it stalled {inside} at {status['at']} (stacks above)",
              file=sys.stderr, flush=True)
        os._exit(1)
