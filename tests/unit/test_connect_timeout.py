"""The strategy's ``timeout`` also bounds the start: a rank that never joins must be named with the
option, not left as torch's DistStoreError and screens of C++ frames (found by an independent
check, where Lightning's launcher re-importing the script on a loaded machine took longer than
``timeout=45``)."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_dynmo.strategy.launcher import connect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_never_joins_is_reported_with_the_timeout_option(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)  # not under torchrun
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    env = LightningEnvironment()
    env.set_world_size(2)
    env.set_global_rank(0)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"rank 0 could not join the process group within timeout=2 s .*"
                                           r"Raise DynMoStrategy\(timeout=\.\.\.\)"):
        connect(env, torch.device("cpu"), 0, timedelta(seconds=2))
    assert not dist.is_initialized()
