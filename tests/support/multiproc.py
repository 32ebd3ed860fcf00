"""Helpers for tests that launch real multi-process jobs with torchrun (gloo, 1 thread per rank).

No test picks a port itself (a port found free can be taken before it is bound): single-node jobs
use ``torchrun --standalone`` (the agent binds port 0), two-agent jobs rendezvous through a file.
Every job runs in its own process session; on a timeout the whole group (agent *and* workers) is
killed, so a hung job never outlives its test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "workers" / "pipeline_worker.py"


def worker_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session (its own process group: agent and workers)."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env or worker_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float, log: Path | None = None) -> Finished:
    """Wait for ``proc``; on timeout kill its whole process group and fail. Stray processes of
    the group are killed either way."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        if log is not None:
            log.write_text(out + "\n" + err)
        raise AssertionError(f"job timed out after {timeout} s; killed its process group (agent and workers)\n"
                             f"{err[-4000:]}") from None
    finally:
        _kill_group(proc.pid)
    if log is not None:
        log.write_text(out + "\n" + err)
    return Finished(proc.returncode, out, err)


def run(cmd: list[str], timeout: float, log: Path | None = None, env: dict | None = None) -> Finished:
    return finish(start(cmd, env), timeout, log)


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
            str(script), *args]


def _failure(proc: Finished, log: Path) -> AssertionError:
    key = [l for l in proc.output.splitlines()
           if any(w in l for w in ("Error", "error:", "terminate", "what()", "Abort"))]
    return AssertionError(f"worker failed ({proc.returncode}); full log {log}\n" + "\n".join(key[-30:])
                          + f"\n{proc.stderr[-4000:]}")


def write_spec(tmp: Path, runs: list[dict]) -> tuple[Path, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    spec, out = tmp / "spec.json", tmp / "result.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    return spec, out


def run_worker(tmp: Path, nproc: int, runs: list[dict], timeout: int = 600, worker: Path = WORKER,
               env: dict | None = None) -> list[dict]:
    """Launch ``runs`` in one torchrun job of ``nproc`` ranks (``nproc=None``: one plain process,
    no torchrun); return rank 0's results."""
    spec, out = write_spec(tmp, runs)
    cmd = torchrun(nproc, worker, str(spec)) if nproc else [sys.executable, str(worker), str(spec)]
    proc = run(cmd, timeout, tmp / "worker.log", env)
    if proc.returncode != 0:
        raise _failure(proc, tmp / "worker.log")
    return json.loads(out.read_text())["runs"]


def run_two_agents(tmp: Path, runs: list[dict], timeout: int = 300, worker: Path = WORKER) -> list[dict]:
    """Two torchrun agents (``--nnodes 2``, one process each) on this machine form one job. They
    meet through a file rendezvous (no port is chosen by the test); the agent of node 0 picks the
    workers' port itself."""
    spec, out = write_spec(tmp, runs)
    rdzv = tmp / "rendezvous"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", str(rdzv), "--rdzv-conf", "store_type=file",
           "--rdzv-id", "test", str(worker), str(spec)]
    procs = [start(cmd) for _ in range(2)]
    try:
        done = [finish(p, timeout, tmp / f"agent{node}.log") for node, p in enumerate(procs)]
    finally:
        for p in procs:
            _kill_group(p.pid)
    for node, proc in enumerate(done):
        if proc.returncode != 0:
            raise _failure(proc, tmp / f"agent{node}.log")
    return json.loads(out.read_text())["runs"]
