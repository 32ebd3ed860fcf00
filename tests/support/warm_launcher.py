"""A warm launcher for the tests' torchrun jobs: torch's own elastic agent, with the imports paid once.

Each rank of a torchrun job is a fresh interpreter that imports torch, Lightning and what Lightning
imports (torchmetrics, which imports transformers and scipy): 11-14 s of CPU per rank on a 2-core
CI machine, so a 4-rank job spends ~35 s before its first step and the suite's ~110 jobs spend most
of their time importing. This process imports all of it once, stays free of threads, and for each
job forks a *job leader* that runs exactly what ``torchrun`` runs -- ``torch.distributed.run``'s
argument parser and ``config_from_args``, then ``elastic_launch`` with the same rendezvous, agent
and worker environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*) -- except that the
agent starts its workers with torch's ``fork`` start method and a function that runs the worker
script as ``__main__`` (``runpy``), instead of ``python script.py``. Workers are real processes
over gloo, as before; only the interpreter start is shared.

What this does not cover, and stays on the ``torchrun`` command line (``tests/support/multiproc``):
signals, killed ranks and restarts, multi-node rendezvous, recipes, and every job whose test sets
environment variables that torch or Lightning read at import time. ``DYNMO_TEST_LAUNCHER=torchrun``
sends every job back to the command line.

Protocol (one job at a time, lines of JSON): the test writes a request on stdin
``{"argv": [...torchrun's args...] | null, "script": path, "args": [...], "env": {...}, "cwd": ...,
"stdout": path, "stderr": path}`` (``argv`` null: run ``script args`` as one plain process); this
process answers ``{"pid": leader}`` (the leader leads its own session: killing that process group
kills the agent and its workers) and, when the leader has exited, ``{"returncode": n}``.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import traceback
import uuid


#: signal handlers of a fresh interpreter (this process's, taken before anything installs one): a
#: forked worker would otherwise inherit the agent's, which turn its SIGTERM into an exception that
#: a rank blocked in C++ never sees, where a fresh worker dies at once
_FRESH_HANDLERS: dict = {}
#: left to faulthandler (a C handler Python's ``signal`` does not see): torch's worker wrapper enables
#: it, and a crashed rank's Python stack is the first clue to a native crash
_FATAL = {signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL}


def _run_script(script: str, *args: str) -> None:
    """A worker: run ``script`` as ``python script args...`` would."""
    for sig, handler in _FRESH_HANDLERS.items():
        signal.signal(sig, handler)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # exit(0) is a normal end; any other code is the worker's status
        if exc.code not in (0, None):
            raise
    finally:  # an interpreter runs them as it exits; a forked worker ends in os._exit
        atexit._run_exitfuncs()


def _launch(argv: list[str]) -> int:
    """What ``python -m torch.distributed.run ARGV`` does, with forked function workers."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    if args.standalone:  # as torch.distributed.run.run does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    args.start_method = "fork"
    config, _, _ = config_from_args(args)

    def entrypoint(*script_and_args: str) -> None:
        _run_script(*script_and_args)

    # the agent names a job by its entrypoint ("<script> FAILED" in the summary), as torchrun does
    entrypoint.__name__ = entrypoint.__qualname__ = os.path.basename(args.training_script)
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(args.training_script, *args.training_script_args)
    except ChildFailedError:
        traceback.print_exc()  # torchrun's report: the traceback, then the failed ranks' summary
        return 1
    return 0


def _leader(req: dict) -> int:
    """The forked job leader: its own session, the request's files, environment and directory."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if req["argv"] is None:  # one plain process
        _run_script(req["script"], *req["args"])
        return 0
    return _launch(req["argv"])


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def serve() -> None:
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if handler is not None and sig not in (signal.SIGKILL, signal.SIGSTOP, *_FATAL):
            _FRESH_HANDLERS[sig] = handler
    import torch  # noqa: F401
    import torch.distributed.run  # noqa: F401  (torchrun's parser and config)
    import lightning  # noqa: F401
    import lightning_dynmo  # noqa: F401
    import tests.support.workers.common  # noqa: F401
    if _threads() != 1:  # forking a process with threads could inherit a held lock
        print(json.dumps({"error": f"{_threads()} threads after the imports; cannot fork safely"}), flush=True)
        return
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _leader(req)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - reported in the job's stderr, like a crashed torchrun
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
