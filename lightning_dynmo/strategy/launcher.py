"""Process launchers: Lightning's own, plus a spawn launcher that returns the whole model."""
from __future__ import annotations

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher


class PipelineSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher hands rank 0's ``state_dict`` back to the main process; on a
    pipeline rank 0 owns only its own layers, so hand back the gathered full model instead."""

    def _collect_rank_zero_results(self, trainer, results):
        module = trainer.lightning_module
        full = self._strategy.lightning_module_state_dict()  # collective: every rank calls it
        original = module.state_dict
        module.state_dict = lambda *a, **k: full  # what the parent class saves for the main process
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            module.state_dict = original


def die_with_launcher(local_rank: int) -> None:
    """Make this process die (SIGKILL) when the process that launched it dies, so that after a
    failure no rank outlives its launcher (torchrun's agent, Lightning's rank 0, a spawn parent).
    Only for launched processes: a rank 0 that the user started (and that launched the others)
    keeps its ordinary life, so ``nohup python train.py &`` survives its shell. Linux only."""
    import ctypes
    import multiprocessing
    import os
    import signal
    import sys

    launched = ("TORCHELASTIC_RUN_ID" in os.environ or local_rank > 0
                or multiprocessing.parent_process() is not None)
    if not launched or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os._exit(1)


def seeded_loader_for_one_replica(dataloader):
    """With one data-parallel replica no sampler is injected, so every rank of a pipeline iterates
    the loader itself; a ``RandomSampler`` drawing from the global RNG would give the ranks
    different orders (their RNGs drift apart: dropout runs on different layers). Give it a
    generator seeded with ``PL_GLOBAL_SEED`` (same on every rank; a new permutation each epoch).
    Loaders that do not shuffle, or shuffle with their own generator, are returned as they are."""
    import os

    import torch
    from torch.utils.data import DataLoader, RandomSampler

    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(dataloader, DataLoader) or type(sampler) is not RandomSampler or sampler.generator is not None:
        return dataloader
    from lightning.pytorch.utilities.data import _update_dataloader

    generator = torch.Generator().manual_seed(int(os.environ.get("PL_GLOBAL_SEED", 0)))
    seeded = RandomSampler(sampler.data_source, replacement=sampler.replacement,
                           num_samples=sampler._num_samples, generator=generator)
    return _update_dataloader(dataloader, seeded)


def restart_safe_store(timeout):
    """Under torchrun (its agent hosts the store), the store of this restart attempt: torchrun
    keeps one store server for every attempt of a job and its workers' keys carry no attempt
    number, so after a restart a rank that starts late leaves its peers reading the *previous*
    attempt's address for it (gloo: "Connection refused" to a dead port, and the restart fails).
    A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps attempts apart. None elsewhere."""
    import os

    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        world = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dynmo/attempt_{attempt}", client)


def connect(cluster_environment, root_device, local_rank: int, timeout, backend: str | None = None) -> None:
    """Join the process group (every rank): ``backend`` or the device's default, every
    collective under ``timeout``; under torchrun a store that holds this attempt's keys only."""
    import atexit

    import torch.distributed as dist
    from lightning.fabric.utilities.distributed import (
        _destroy_dist_connection,
        _get_default_process_group_backend_for_device,
        _init_dist_connection,
    )

    backend = backend or _get_default_process_group_backend_for_device(root_device)
    kwargs = {"timeout": timeout}
    if root_device.type != "cpu":
        kwargs["device_id"] = root_device
    try:
        store = None if dist.is_initialized() else restart_safe_store(timeout)
        if store is not None:  # torchrun (--max-restarts): this attempt's keys only, no stale peer addresses
            kwargs["store"] = store
        _init_dist_connection(cluster_environment, backend, **kwargs)
    except RuntimeError as err:  # DistStoreError / DistNetworkError: a rank did not arrive in time
        if not isinstance(err, getattr(dist, "DistError", ())) and "timed out" not in str(err).lower():
            raise
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(
            f"rank {cluster_environment.global_rank()} could not join the process group within timeout={seconds:g} s "
            f"({type(err).__name__}: {first[:300]}). The strategy's `timeout` also bounds the start, when every rank "
            "must reach it: a rank still importing (Lightning's launcher re-runs the script for each rank, which can "
            "take a minute on a loaded machine), a rank that failed before it, or a wrong MASTER_ADDR/MASTER_PORT "
            "keeps the others waiting. Raise DynMoStrategy(timeout=...) or read the other ranks' output") from err
    die_with_launcher(local_rank)  # a rank must not outlive the process that launched it
    if backend != "nccl":  # Lightning registers this for NCCL only; gloo threads need it too
        atexit.register(_destroy_dist_connection)
