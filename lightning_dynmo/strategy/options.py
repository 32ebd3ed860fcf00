"""``DynMoStrategy``'s options: :class:`PipelineOptions` is the one place where each option is
named, typed, documented and given its default. Everything else is derived from it: the
strategy's keyword arguments, the rebalance policy and overhead budget, the Hydra structured
config (:mod:`lightning_dynmo.strategy.hydra_config`) and ``docs/options.md``
(``python -m lightning_dynmo.strategy.options_doc > docs/options.md``)."""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from datetime import timedelta
from enum import StrEnum
from numbers import Integral, Real
from typing import Any, Literal

from ..plan.balancers import get_balancer
from ..plan.budget import OverheadBudget
from ..plan.partition import Partition
from ..plan.policy import Rebalance, RebalancePolicy
from ..plan.repack import check_repack_target
from ..plan.schedules import ScheduleSpec, get_schedule
from ..plan.validation import enum_value, positive_int
from ..runtime.recompute import check_activation_checkpointing
from .nonfinite import OnNonfinite


class StartMethod(StrEnum):
    """How Lightning starts the other ranks: the ``start_method`` option."""

    POPEN = "popen"
    SPAWN = "spawn"
    FORK = "fork"
    FORKSERVER = "forkserver"


class DpSharding(StrEnum):
    """What a stage's data-parallel replicas hold: the ``dp_sharding`` option."""

    REPLICATE = "replicate"
    FSDP = "fsdp"


class CheckpointFormat(StrEnum):
    """How checkpoints are written: the ``checkpoint_format`` option."""

    SINGLE = "single"
    DCP = "dcp"


@dataclass(frozen=True)
class PipelineOptions:
    """Every ``DynMoStrategy`` option with its default, checked and normalised at construction
    (before any process starts): ``schedule`` becomes its ``ScheduleSpec``, ``virtual_stages``
    the schedule's count, ``timeout`` a ``timedelta``, the modes their enum members."""

    pipeline_parallel: int | Literal["auto"] = "auto"
    """Ranks per pipeline (``"auto"``: all processes form one pipeline); data-parallel replicas =
    devices x num_nodes / pipeline_parallel."""
    schedule: str | ScheduleSpec = "1f1b"
    """A ``torch.distributed.pipelining`` schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``,
    ``looped_bfs``, ``zero_bubble``, ``zbv`` or ``dualpipev`` (DeepSeek's DualPipeV: ZBV's V layout
    of 2 stages per rank, a forward of one stage paired with a backward of the other, which torch
    runs one after the other; it needs at least 2 micro-batches per rank, any count above)."""
    microbatches: int | None = None
    """Micro-batches per step; ``None``: the largest divisor of the batch size that is at most
    4 x stages (and at least the rank count where the schedule needs it, twice it under
    ``dualpipev``). An epoch's last, partial batch that the count does not divide runs as fewer
    equal micro-batches."""
    virtual_stages: int | None = None
    """Stages per rank for interleaved and looped schedules (``None``: 2; ZBV and DualPipeV: 2; 1 for the others)."""
    balancer: str = "partition_time"
    """Balancer of the initial partition (from parameter counts, before any step) and of every
    rebalance (on profiled per-layer times): ``partition_time`` (the exact min-max contiguous
    partition of stage time), ``uniform``, ``param``, ``partition_param``, ``diffusion_time``,
    ``diffusion_param``, or one registered with ``@register_balancer``."""
    partition: tuple[int, ...] | Partition | None = None
    """Explicit initial stage boundaries, e.g. ``[0, 5, 9]``, overriding ``balancer`` for step 0."""
    rebalance: Rebalance = Rebalance.AUTO
    """When to rebalance: ``auto`` (after a callback's ``request_rebalance`` and when the busy-time
    imbalance exceeds ``imbalance_threshold``, applied only when the predicted saving over
    ``rebalance_horizon`` steps exceeds the measured migration cost), ``on_event`` (after
    ``request_rebalance``), ``every_n`` (every ``rebalance_interval`` steps) or ``never`` (a static
    partition; requests are ignored with a warning)."""
    rebalance_interval: int = 50
    """Steps between rebalances under ``rebalance="every_n"``."""
    imbalance_threshold: float = 0.1
    """``auto`` profiles and decides when the busy-time imbalance (max - min) / mean exceeds this."""
    rebalance_horizon: int = 100
    """``auto`` applies a move only when its predicted saving over this many steps exceeds the
    measured migration cost; it also never returns within this many steps to a partition it left."""
    rebalance_cooldown: int = 10
    """Steps without automatic profiling after any decision, applied or not (a rank's confirmed
    speed drift, decided without profiling, waits only after an applied one)."""
    rebalance_hysteresis: float = 0.5
    """After a decision that changed nothing, ``auto`` fires again only once the imbalance has grown
    by this fraction, or fell below ``imbalance_threshold x (1 - rebalance_hysteresis)`` first."""
    profile_steps: int = 1
    """Consecutive steps one per-layer profile spans; decisions use each layer's mean over them (2-3
    where step times are noisy, e.g. a shared machine)."""
    rank_speeds: bool | Literal["always"] = False
    """Measure each pipeline rank's speed (its layers' times against their work) and balance for it:
    ``auto`` then moves layers off a rank that slows down and back when it recovers (see
    docs/dynamism.md, Stragglers; it profiles once at step 1 for the work speeds are measured
    against, when nothing else profiled first). Off by default: ranks that share CPU cores or a
    device measure each other's load, not their own speed, and every rank then counts as alike.
    On CPU ranks whose threads outnumber the host's cores it is turned off at setup, with a warning;
    ``"always"`` keeps it on there, for ranks whose work does not hold a core (ranks that wait on a
    device or a remote service, or the emulated cluster of ``benchmarks/emulated_scale.py``, whose
    layers sleep for their cost)."""
    overhead_budget: float = 0.01
    """Under ``auto``, the share of the training time that the profiling and decisions the policy
    starts by itself may cost over the last ``max(100, rebalance_horizon)`` steps (more when the
    last applied decision measurably paid for itself); ``inf``: no limit. Events are always served."""
    memory_capacity: float | None = None
    """Bytes a stage may hold (parameters, gradients, optimizer state, in-flight activations);
    balancers never exceed it. ``None``: unlimited."""
    link_bandwidth: float | tuple[float, float] | None = None
    """Bytes/s of the links between pipeline ranks, so balancers charge each stage its input's
    transfer: ``None`` charges nothing, one number every boundary alike, a pair
    ``(intra_node, inter_node)`` each boundary by whether its ranks share a node, e.g.
    ``(3.6e11, 4.5e10)`` for NVLink inside and InfiniBand between nodes of H100s."""
    repack: int | str = "off"
    """``off``, a target number of pipeline ranks, or ``auto``: after a rebalance, move the layers onto
    the fewest ranks whose balanced partition fits memory and keeps the predicted step time within
    ``repack_tolerance``; the other ranks are released."""
    repack_tolerance: float = 0.05
    """How much slower (predicted) a packed pipeline may be than the current one, in [0, 1)."""
    plot: bool = True
    """Save a pipeline-timeline and stage-load PNG next to the logs for applied rebalances."""
    plot_interval: int = 50
    """At most one plot per this many steps."""
    on_nonfinite: OnNonfinite = OnNonfinite.ERROR
    """A step whose training loss is NaN/Inf: ``error`` (stop, naming the step), ``skip`` (apply no
    update for that step, warn) or ``ignore``."""
    activation_checkpointing: bool | Literal["auto"] = False
    """``True`` recomputes every layer's forward in backward, ``"auto"`` only the layers a stage needs
    to fit ``memory_capacity``, ``False`` none."""
    expert_parallel: int = 1
    """Split each MoE layer's experts over this many data-parallel replicas of its stage (must
    divide the replica count and every layer's ``num_experts``); 1: every replica holds every expert."""
    dp_sharding: DpSharding = DpSharding.REPLICATE
    """What each stage's data-parallel replicas hold: ``replicate`` (every replica the whole stage,
    gradients all-reduced once per step) or ``fsdp`` (parameters, gradients and optimizer state
    sharded over the replicas with FSDP2's ``fully_shard``, one unit per pipeline layer; see
    docs/parallelism.md). Needs torch >= 2.13 (refused on 2.10/2.11); precision 32-true, bf16-mixed,
    16-mixed or bf16-true. Tied parameters, expert parallelism and pruning work under both."""
    compile: bool = False
    """``torch.compile`` each pipeline layer this rank owns, in place (state-dict keys unchanged); a
    layer that arrives by migration is compiled on its new rank."""
    timeout: float | timedelta = 600.0
    """Seconds (or a ``timedelta``) every collective may wait, the start's rendezvous included (every rank
    must have imported the script and reached it); a dead or stuck rank makes the others fail, naming it."""
    start_method: StartMethod = StartMethod.POPEN
    """``popen`` (re-run the script, like torchrun) or ``spawn``/``fork``/``forkserver`` (notebooks)."""
    process_group_backend: str | None = None
    """``torch.distributed`` backend; ``None``: gloo on CPU, NCCL on GPU."""
    checkpoint_format: CheckpointFormat | None = None
    """``single``: one single-process file gathered onto rank 0; ``dcp``: a directory where every rank
    writes its own layers with ``torch.distributed.checkpoint`` (nothing gathered; replicas written
    once; fsdp shards written as shards). Either loads onto any layout;
    ``lightning_dynmo.consolidate_checkpoint`` turns a ``dcp`` directory into a ``single`` file.
    ``None``: ``dcp`` under ``dp_sharding="fsdp"``, ``single`` otherwise."""

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "PipelineOptions":
        """``PipelineOptions(**kwargs)``, with unknown names refused naming the closest option."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; options: {', '.join(names)}"
                raise TypeError(f"DynMoStrategy got an unknown option {key!r}{hint}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        pp = positive_int("pipeline_parallel", self.pipeline_parallel, allow=("auto",))
        positive_int("expert_parallel", self.expert_parallel)
        spec = get_schedule(self.schedule)
        put("schedule", spec)
        put("virtual_stages", spec.virtual_stages(self.virtual_stages))
        mb = positive_int("microbatches", self.microbatches, allow=(None,))
        if mb is not None and pp != "auto":
            spec.check_microbatches(mb, pp)
        get_balancer(self.balancer)  # unknown names fail here, listing the valid ones
        if self.partition is not None:
            if not isinstance(self.partition, Partition) and (isinstance(self.partition, (str, bytes)) or not all(
                    isinstance(b, Integral) and not isinstance(b, bool) for b in self.partition)):
                raise ValueError("partition must be the stage boundaries as a sequence of layer indices, e.g. "
                                 f"(0, 3, 7) for stages 0-2 and 3-6 of 7 layers, got {self.partition!r}")
            put("partition", Partition(tuple(self.partition)))
        cap = self.memory_capacity
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, Real) or not cap > 0):
            raise ValueError(
                f"memory_capacity must be a positive number of bytes per stage (e.g. 8e9) or None, got {cap!r}")
        put("link_bandwidth", check_link_bandwidth(self.link_bandwidth))
        if self.repack != "off":
            try:
                check_repack_target(self.repack)
            except ValueError:
                raise ValueError(f"repack must be 'off', 'auto' or a positive number of pipeline ranks, "
                                 f"got {self.repack!r}") from None
            if isinstance(self.repack, int) and pp != "auto" and self.repack >= pp:
                raise ValueError(f"repack={self.repack} can never apply: it packs the pipeline onto fewer ranks than "
                                 f"pipeline_parallel={pp}; use a number below {pp}, 'auto' or 'off'")
        if not 0 <= self.repack_tolerance < 1:
            raise ValueError(f"repack_tolerance must be in [0, 1), got {self.repack_tolerance!r}")
        put("repack_tolerance", float(self.repack_tolerance))
        if not isinstance(self.plot, bool):
            raise ValueError(f"plot must be True or False (rebalance plots in the log directory), got {self.plot!r}")
        positive_int("plot_interval", self.plot_interval)
        put("on_nonfinite", enum_value("on_nonfinite (what to do when a step's training loss is NaN/Inf)",
                                       OnNonfinite, self.on_nonfinite))
        put("activation_checkpointing",
            check_activation_checkpointing(self.activation_checkpointing, self.memory_capacity))
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False (torch.compile each pipeline layer), got {self.compile!r}")
        if not isinstance(self.rank_speeds, bool) and self.rank_speeds != "always":
            raise ValueError(f"rank_speeds must be True, False or 'always' (measure each rank's speed and balance "
                             f"for it; 'always': also where CPU ranks share cores), got {self.rank_speeds!r}")
        put("start_method", enum_value("start_method", StartMethod, self.start_method))
        put("dp_sharding", enum_value("dp_sharding", DpSharding, self.dp_sharding))
        if self.checkpoint_format is None:  # by dp_sharding: a sharded model is saved sharded
            sharded = self.dp_sharding is DpSharding.FSDP
            put("checkpoint_format", CheckpointFormat.DCP if sharded else CheckpointFormat.SINGLE)
        put("checkpoint_format", enum_value("checkpoint_format", CheckpointFormat, self.checkpoint_format))
        put("timeout", check_timeout(self.timeout))
        put("process_group_backend", check_backend(self.process_group_backend))
        put("rebalance", enum_value("rebalance", Rebalance, self.rebalance))
        self.policy(), self.budget()  # the policy's and the budget's own checks, once, here

    def policy(self) -> RebalancePolicy:
        """A fresh rebalance policy (its state starts empty) with these settings."""
        return RebalancePolicy(rebalance=self.rebalance, rebalance_interval=self.rebalance_interval,
                               imbalance_threshold=self.imbalance_threshold, rebalance_horizon=self.rebalance_horizon,
                               rebalance_cooldown=self.rebalance_cooldown,
                               rebalance_hysteresis=self.rebalance_hysteresis,
                               profile_steps=self.profile_steps)

    def budget(self) -> OverheadBudget:
        """A fresh overhead budget over the last ``max(100, rebalance_horizon)`` steps."""
        return OverheadBudget(overhead_budget=self.overhead_budget, window=max(100, self.rebalance_horizon))


def check_timeout(value) -> timedelta:
    """``timeout`` (seconds or a timedelta) as a positive timedelta."""
    seconds = value
    if isinstance(value, Real) and not isinstance(value, bool):
        seconds = timedelta(seconds=float(value)) if math.isfinite(value) and value > 0 else None
    if not isinstance(seconds, timedelta) or seconds.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {value!r}")
    return seconds


def check_backend(value: str | None) -> str | None:
    """``process_group_backend``: None (gloo on CPU, nccl on GPU), a backend torch knows, or
    torch's per-device form (``"cpu:gloo,cuda:nccl"``)."""
    if value is None:
        return None
    import torch.distributed as dist

    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    names = [part.split(":")[-1].strip().lower() for part in str(value).split(",")] if isinstance(value, str) else []
    if not names or any(n not in known for n in names):
        raise ValueError(f"process_group_backend must be None (gloo on CPU, nccl on GPU), one of {known} or "
                         f"'device:backend' pairs such as 'cpu:gloo,cuda:nccl', got {value!r}")
    return value


def check_link_bandwidth(value) -> float | tuple[float, float] | None:
    """``link_bandwidth`` as None, a float or an ``(intra_node, inter_node)`` pair of floats."""
    fix = ("link_bandwidth must be None, bytes/s of every pipeline link (a finite number > 0, e.g. 4.5e10) or a "
           "pair (intra_node, inter_node) of them, e.g. (3.6e11, 4.5e10)")
    if value is None:
        return None

    def rate(v) -> float:
        if isinstance(v, bool) or not isinstance(v, Real) or not 0 < float(v) < math.inf:
            raise ValueError(f"{fix}; got {value!r}")
        return float(v)

    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{fix}; got {len(value)} values {value!r}")
        return rate(value[0]), rate(value[1])
    return rate(value)
