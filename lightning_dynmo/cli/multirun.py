"""Hydra multirun (``-m``) with Lightning's script launcher (the GPT recipe calls it).

Lightning starts ranks > 0 by re-running the script with ``sys.argv[1:]`` plus
``hydra.run.dir=<HydraConfig run.dir>``. Under ``-m`` that command would be the whole sweep again
(``-m strategy.balancer=uniform,param``) writing into the single-run directory: every child would
start its own sweep. :func:`prepare_multirun_children` makes the children run exactly the current
job: ``sys.argv`` becomes this job's own overrides and the run directory this job's sweep
sub-directory. Jobs run one after another in the same rank-0 process, whose process group from
the previous job still points at that job's (finished) children: it is destroyed, and the
previous job's launch variables forgotten (Lightning sets ``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE`` and ``MASTER_PORT`` in the launching process), so each job launches its own
children and forms a fresh group with them. It does nothing outside multirun or in a child rank.
"""
from __future__ import annotations

import os
import sys

#: Whether this process started as the launcher (no LOCAL_RANK when this module was first imported,
#: i.e. during the first job, before Lightning set it).
_LAUNCHER = "LOCAL_RANK" not in os.environ
_LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")


def prepare_multirun_children() -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    if not HydraConfig.initialized() or not _LAUNCHER:
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # left over from the previous job
        dist.destroy_process_group()
    for var in _LAUNCH_VARS:
        os.environ.pop(var, None)
    overrides = [o for o in hc.overrides.task if not o.startswith("hydra.run.dir=")]
    sys.argv = [sys.argv[0], *overrides]
    readonly = OmegaConf.is_readonly(hc)
    OmegaConf.set_readonly(hc, False)
    with open_dict(hc):
        hc.run.dir = hc.runtime.output_dir  # Lightning passes this as the child's hydra.run.dir
    OmegaConf.set_readonly(hc, readonly)
