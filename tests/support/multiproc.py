"""Helpers for tests that launch real multi-process jobs with torchrun (gloo, 1 thread per rank).

No test picks a port itself (a port found free can be taken before it is bound): single-node jobs
use ``torchrun --standalone`` (the agent binds port 0), two-agent jobs rendezvous through a file.
Every job runs in its own process session; on a timeout the whole group (agent *and* workers) is
killed, so a hung job never outlives its test.

``run_worker`` hands its jobs to a warm launcher (``warm_launcher.py``: torchrun's own agent and
configuration, with the imports paid once per test session instead of once per rank);
``DYNMO_TEST_LAUNCHER=torchrun`` sends them to the command line like every other job here.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "workers" / "pipeline_worker.py"


def worker_env(**extra: str) -> dict:
    env = dict(os.environ)
    # faulthandler: a rank that crashes in native code prints its Python stack
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def user_env(**extra: str) -> dict:
    """:func:`worker_env` as a user's shell has it: this checkout's lightning_dynmo (as `pip install -e .`
    gives a user), nothing that makes a process look like a launched child rank."""
    env = worker_env(**extra)
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"):
        env.pop(k, None)
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


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


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


def _native_crash(output: str) -> str:
    """The Python stack faulthandler printed for a rank killed by a signal (SIGSEGV, SIGBUS, ...),
    or ``""``: the crashing thread's first frames, which a long log's tail would otherwise cut."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error:"):
            block = [line]
            for more in lines[i + 1:i + 40]:
                if not more.strip() and len(block) > 3:
                    break
                block.append(more)
            return "\n".join(block)
    return next((l for l in lines if "(SIGSEGV)" in l or "(SIGBUS)" in l or "(SIGILL)" in l), "")


def _failure(proc: Finished, log: Path) -> AssertionError:
    key = [l for l in proc.output.splitlines()
           if any(w in l for w in ("Error", "error:", "terminate", "what()", "Abort"))]
    crash = _native_crash(proc.output)
    return AssertionError(f"worker failed ({proc.returncode}); full log {log}\n" + "\n".join(key[-30:])
                          + f"\n{proc.stderr[-4000:]}"
                          + (f"\n--- the crashed rank's stack ---\n{crash}" if crash else ""))


class WarmLauncher:
    """The test session's one ``warm_launcher.py`` process, started on first use. If it cannot
    start (or ``DYNMO_TEST_LAUNCHER=torchrun``), jobs go to the torchrun command line."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.broken: str | None = None
        self.job: int | None = None  # the running job's leader (its process group)
        self._buf = b""

    def available(self) -> bool:
        if os.environ.get("DYNMO_TEST_LAUNCHER", "warm") == "torchrun" or self.broken:
            return False
        if self.proc is not None and self.proc.poll() is None:
            return True
        log = tempfile.NamedTemporaryFile(prefix="warm_launcher.", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.warm_launcher"], cwd=ROOT,
                                     env=worker_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, bufsize=0, start_new_session=True)
        self._buf = b""
        msg = self._read(300)
        if not msg or "ready" not in msg:
            self.close()
            self.broken = f"{msg or 'no answer'} (its log: {log.name})"
            warnings.warn(f"warm launcher unavailable, jobs use the torchrun command line: {self.broken}")
            return False
        atexit.register(self.close)
        return True

    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd: list[str], timeout: float, log: Path | None = None) -> Finished:
        """``cmd``: a ``torchrun()`` command or ``[python, script, args...]``."""
        outdir = Path(tempfile.mkdtemp(prefix="job."))
        out, err = outdir / "stdout", outdir / "stderr"
        job = ({"argv": cmd[3:], "script": None, "args": []} if cmd[1:3] == ["-m", "torch.distributed.run"]
               else {"argv": None, "script": cmd[1], "args": cmd[2:]})
        req = {**job, "env": worker_env(), "cwd": str(ROOT), "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        started = self._read(60)
        if started is None:
            self.broken = "stopped answering"
            raise AssertionError("the warm launcher did not start the job")
        pid = self.job = started["pid"]
        done = self._read(timeout)
        _kill_group(pid)  # stray processes of the job, on success too (as finish() does)
        self.job = None
        if done is None:
            if self._read(30) is None:  # the leader's exit, now that its group is killed
                self.broken = "lost track of a timed-out job"
                self.close()
            text_out, text_err = out.read_text(errors="replace"), err.read_text(errors="replace")
            if log is not None:
                log.write_text(text_out + "\n" + text_err)
            raise AssertionError(f"job timed out after {timeout} s; killed its process group (agent and workers)\n"
                                 f"{text_err[-4000:]}")
        text_out, text_err = out.read_text(errors="replace"), err.read_text(errors="replace")
        shutil.rmtree(outdir, ignore_errors=True)
        if log is not None:
            log.write_text(text_out + "\n" + text_err)
        return Finished(done["returncode"], text_out, text_err)

    def close(self) -> None:
        if self.job is not None:  # interrupted while a job ran: it leads its own session
            _kill_group(self.job)
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc.pid)
            self.proc.wait()


WARM = WarmLauncher()


def launch(cmd: list[str], timeout: float, log: Path | None = None) -> Finished:
    """Run a ``torchrun()`` or plain ``[python, script, ...]`` command with ``worker_env()``: on the
    warm launcher where it is available, else on the command line."""
    if not WARM.available():
        return run(cmd, timeout, log)
    proc = WARM.run(cmd, timeout, log)
    crash = _native_crash(proc.output) if proc.returncode != 0 else ""
    if crash:  # a forked worker's native crash: the job runs again as torchrun would start it
        warnings.warn(f"a rank of a warm-launched job crashed (its stack below); rerunning the job on the "
                      f"torchrun command line, where a crash of the code itself happens again\n{crash}")
        proc = run(cmd, timeout, log)
    return proc


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
    proc = launch(cmd, timeout, tmp / "worker.log") if env is None else run(cmd, timeout, tmp / "worker.log", env)
    if proc.returncode != 0:
        raise _failure(proc, tmp / "worker.log")
    return json.loads(out.read_text())["runs"]


def run_named(tmp: Path, nproc: int | None, runs: dict[str, dict], **kwargs) -> dict[str, dict]:
    """:func:`run_worker` on named runs, in one job: rank 0's result of each run by its name."""
    names = list(runs)
    return dict(zip(names, run_worker(tmp, nproc, [runs[n] for n in names], **kwargs)))


def run_named_pairs(tmp: Path, nproc: int | None, runs: dict[str, dict], **kwargs) -> dict[str, tuple[dict, dict]]:
    """:func:`run_named`, each result beside its run's configuration: ``{name: (config, result)}``."""
    return {n: (runs[n], r) for n, r in run_named(tmp, nproc, runs, **kwargs).items()}


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
