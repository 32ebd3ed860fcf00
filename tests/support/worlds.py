"""Small gloo worlds for single-process unit tests: a one-rank world in the test's own process
(what an engine, a decision's agreement or a migration's bookkeeping needs to run), and a few
ranks forked from it (what a collective's disagreement needs, without torchrun or a new
interpreter's imports). Both rendezvous through a file, so no test picks a port."""
from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank gloo process group for the test, destroyed after it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _forked_rank(fn, rank: int, world: int, store: str, queue) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        try:
            queue.put((rank, "ok", fn(rank, world)))
        finally:
            dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - handed to the test, which decides
        queue.put((rank, "raised", (type(err).__name__, str(err), traceback.format_exc())))


def forked_ranks(fn: Callable[[int, int], Any], world: int, tmp_path: Path, timeout: float = 60.0) -> list[tuple]:
    """Run ``fn(rank, world)`` on ``world`` gloo ranks forked from this process; returns, by rank,
    ``("ok", result)`` or ``("raised", (type name, message, traceback))``. A rank that neither
    answers nor exits within ``timeout`` fails the test (every rank is killed)."""
    if dist.is_initialized():
        raise RuntimeError("forked_ranks needs a process without a process group (the ranks inherit it)")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store = str(tmp_path / f"forked_pg_{world}")
    procs = [ctx.Process(target=_forked_rank, args=(fn, r, world, store, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    try:
        for _ in range(world):
            rank, kind, value = queue.get(timeout=timeout)
            out[rank] = (kind, value)
    except Exception as err:  # queue.Empty: a rank hung or died without answering
        raise AssertionError(f"forked ranks answered {sorted(out)} of {world} within {timeout} s") from err
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]
