"""Helpers for tests that launch real multi-process jobs with torchrun (gloo, 1 thread per rank)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "workers" / "pipeline_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_worker(tmp: Path, nproc: int, runs: list[dict], timeout: int = 600) -> list[dict]:
    """Launch ``runs`` in one torchrun job of ``nproc`` ranks; return rank 0's results."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "spec.json"
    out = tmp / "result.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--standalone", str(WORKER), str(spec),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    (tmp / "worker.log").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        key = [l for l in (proc.stdout + proc.stderr).splitlines()
               if any(w in l for w in ("Error", "error:", "terminate", "what()", "Abort"))]
        raise AssertionError(f"worker failed ({proc.returncode}); full log {tmp / 'worker.log'}\n"
                             + "\n".join(key[-30:]) + f"\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())["runs"]
