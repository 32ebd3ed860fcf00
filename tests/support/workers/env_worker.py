"""Reports what a torchrun worker sees (for tests/distributed/test_warm_launcher.py).

Usage: torchrun --nproc-per-node N env_worker.py SPEC.json
SPEC: {"out": path, "runs": [{"case": "env" | "fail" | "hang" | "exit" | "crash" | "crash_once"}]}. ``env``: rank 0 writes
every rank's launch environment, signal handlers and ``sys.argv`` after an all-gather over gloo,
and each rank creates ``OUT.atexit<rank>`` from an ``atexit`` handler; ``fail`` raises on rank 1;
``hang`` writes ``OUT.pid<rank>`` and sleeps forever; ``exit`` calls ``sys.exit(3)`` on rank 1; ``crash`` segfaults rank 1 (faulthandler's own
null read, its handler on, as in torch's workers); ``crash_once`` does so only while ``OUT.crashed`` does not exist yet,
then runs ``env``.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import time

import torch.distributed as dist

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")


def _handler(sig: signal.Signals) -> str:
    h = signal.getsignal(sig)
    return getattr(h, "__qualname__", None) or str(h)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    case = spec["runs"][0]["case"]
    rank = int(os.environ["RANK"])
    if case == "hang":
        with open(f"{spec['out']}.pid{rank}", "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(10_000)
    if case == "fail" and rank == 1:
        raise RuntimeError("env_worker: rank 1 failed on purpose")
    if case == "exit" and rank == 1:
        sys.exit(3)
    marker = f"{spec['out']}.crashed"
    if rank == 1 and (case == "crash" or (case == "crash_once" and not os.path.exists(marker))):
        open(marker, "w").close()
        faulthandler.enable()
        faulthandler._sigsegv()
    atexit.register(lambda: open(f"{spec['out']}.atexit{rank}", "w").close())  # runs as the worker exits
    dist.init_process_group("gloo")
    seen = {"env": {k: os.environ.get(k) for k in KEYS}, "argv": sys.argv, "name": __name__, "pid": os.getpid(),
            "signals": {s.name: _handler(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                                                       signal.SIGUSR1, signal.SIGPIPE)}}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump({"runs": [gathered]}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
