"""``DynMoStrategy``'s options, validated once, before any process starts; every consumer (the
rebalancer, its policy, budget and recorder, the engine, the launcher) is built from
:class:`PipelineOptions`."""
from __future__ import annotations

import dis
import math
from dataclasses import dataclass
from datetime import timedelta
from numbers import Real
from typing import Literal

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..plan.balancers import get_balancer
from ..plan.budget import OverheadBudget
from ..plan.partition import Partition
from ..plan.policy import RebalancePolicy
from ..plan.repack import check_repack_target
from ..plan.schedules import ScheduleSpec, get_schedule
from ..plan.validation import positive_int
from ..protocol import PipelineProtocolError, RemoteLayer, pipeline_layers_of
from ..runtime.recompute import check_activation_checkpointing
from ..runtime.expert_parallel import check_expert_parallel_model

DEFAULT_TIMEOUT = timedelta(minutes=10)
START_METHODS = ("popen", "spawn", "fork", "forkserver")
NONFINITE_MODES = ("error", "skip", "ignore")


@dataclass(frozen=True)
class PipelineOptions:
    """Every ``DynMoStrategy`` option, validated (:meth:`validate`).

    Args:
        pipeline_parallel: ranks per pipeline (``"auto"``: all processes form one pipeline).
            Data-parallel replicas = devices x num_nodes / pipeline_parallel.
        schedule: a ``torch.distributed.pipelining`` schedule by name (see
            :func:`lightning_dynmo.available_schedules`).
        microbatches: micro-batches per step; ``None`` picks the largest divisor of the batch
            size that is at most 4 x stages (and at least the stage count where the schedule
            needs it).
        virtual_stages: stages per rank for interleaved schedules (default 2).
        balancer: name of the balancer for the initial partition (from parameter counts, before
            any step) and for rebalancing (on profiled per-layer times). Default
            ``"partition_time"``: the exact min-max contiguous partition of stage time.
        partition: explicit initial boundaries, overriding ``balancer`` for step 0.
        rebalance: ``"auto"`` (default: after a dynamism callback's ``request_rebalance`` and
            when the busy-time imbalance exceeds ``imbalance_threshold``, applied only when the
            predicted saving over ``rebalance_horizon`` steps exceeds the measured migration
            cost), ``"on_event"`` (after ``request_rebalance``), ``"every_n"`` (every
            ``rebalance_interval`` steps) or ``"never"`` (a static partition; requests are
            ignored with a warning).
        rebalance_cooldown: steps without automatic profiling after any decision.
        rebalance_hysteresis: after a decision that changed nothing, ``auto`` fires again only
            once the imbalance has grown by this fraction, or fell below
            ``imbalance_threshold x (1 - rebalance_hysteresis)`` first.
        profile_steps: consecutive steps one per-layer profile spans; decisions use each layer's
            mean over them (1: decide on one step, cheapest; 2-3 when step times are noisy, e.g.
            a shared machine, where one step's measurement can flip a decision back and forth).
        overhead_budget: under ``rebalance="auto"``, the share of the training time that the
            profiling and decisions the policy starts by itself may cost over the last 100 steps
            (more when the last applied decision measurably paid for itself); those that keep
            changing nothing also back off exponentially (see :mod:`lightning_dynmo.plan.budget`).
            ``float("inf")``: no limit. Events (freezing, pruning, re-packing) are always served.
        memory_capacity: bytes a stage may hold (parameters, gradients, optimizer state and the
            activations in flight); balancers never exceed it. ``None``: unlimited.
        link_bandwidth: bytes/s of the links between pipeline ranks, so that the balancers charge
            each stage the time to receive its input activation (and send its gradient back):
            ``None`` (default) charges nothing; one number charges every stage boundary alike; a
            pair ``(intra_node, inter_node)`` charges each boundary by whether its two ranks share a
            node (ranks per node = the processes per node, ``devices``; a boundary that crosses
            nodes in any data-parallel replica counts as inter-node), e.g. ``(3.6e11, 4.5e10)`` for
            NVLink inside and InfiniBand between nodes of H100s.
        repack: ``"off"``, a target number of pipeline ranks, or ``"auto"``: after a rebalance,
            move the layers onto the fewest ranks whose balanced partition fits memory and whose
            predicted step time stays within ``repack_tolerance`` of the current one; the other
            ranks are released (they keep no layers and do no training compute).
        plot: save a pipeline timeline and stage-load PNG next to the logs for applied
            rebalances, at most one per ``plot_interval`` steps.
        on_nonfinite: a step whose training loss is NaN/Inf: ``"error"`` (stop, naming the step),
            ``"skip"`` (apply no update for that step, warn) or ``"ignore"``.
        timeout: timeout of every collective; a dead or stuck rank makes the others fail.
        start_method: ``"popen"`` (re-run the script, like torchrun) or ``"spawn"``/``"fork"``.
        activation_checkpointing: ``True`` recomputes every layer's forward in backward
            (``torch.utils.checkpoint`` per layer), ``"auto"`` only the layers needed for each stage
            to fit ``memory_capacity``, ``False`` none (see :mod:`lightning_dynmo.runtime.recompute`).
        expert_parallel: split each MoE layer's experts over this many data-parallel replicas
            of its stage (must divide the replica count and every layer's ``num_experts``);
            tokens travel to their expert's owner by ``all_to_all`` (see
            :mod:`lightning_dynmo.runtime.expert_parallel`). 1: every replica holds every expert.
        compile: ``torch.compile`` each pipeline layer this rank owns, in place (state-dict keys
            unchanged); a layer that arrives by migration is compiled on its new rank, the others
            are not recompiled (see :mod:`lightning_dynmo.runtime.compile`).
    """

    pipeline_parallel: int | Literal["auto"]
    schedule: ScheduleSpec
    virtual_stages: int
    microbatches: int | None
    balancer: str
    partition: Partition | None
    memory_capacity: float | None
    repack: int | str
    repack_tolerance: float
    plot: bool
    plot_interval: int
    on_nonfinite: str
    timeout: timedelta
    start_method: str
    process_group_backend: str | None
    activation_checkpointing: bool | str = False  # True, False or "auto" (runtime/recompute.py)
    expert_parallel: int = 1  # replicas each stage's experts are split over (runtime/expert_parallel.py)
    compile: bool = False  # torch.compile each local pipeline layer in place (runtime/compile.py)
    rebalance: str = "auto"  # the RebalancePolicy's mode and settings (plan/policy.py)
    rebalance_interval: int = 50
    imbalance_threshold: float = 0.1
    rebalance_horizon: int = 100
    rebalance_cooldown: int = 10
    rebalance_hysteresis: float = 0.5
    profile_steps: int = 1
    overhead_budget: float = 0.01  # share of training time (plan/budget.py)
    link_bandwidth: float | tuple[float, float] | None = None  # bytes/s (plan/layout.py boundary_bandwidth)

    @classmethod
    def validate(cls, *, pipeline_parallel="auto", schedule="1f1b", microbatches=None, virtual_stages=None,
                 balancer="partition_time", partition=None, memory_capacity=None, repack="off", repack_tolerance=0.05,
                 plot=True, timeout=DEFAULT_TIMEOUT, start_method="popen", process_group_backend=None,
                 plot_interval=50, on_nonfinite="error", activation_checkpointing=False, expert_parallel=1,
                 compile=False, rebalance="auto", rebalance_interval=50, imbalance_threshold=0.1,
                 rebalance_horizon=100, rebalance_cooldown=10, rebalance_hysteresis=0.5, profile_steps=1,
                 overhead_budget=0.01, link_bandwidth=None) -> "PipelineOptions":
        pp = positive_int("pipeline_parallel", pipeline_parallel, allow=("auto",))
        positive_int("expert_parallel", expert_parallel)
        spec = get_schedule(schedule)
        virtual = spec.virtual_stages(virtual_stages)
        mb = positive_int("microbatches", microbatches, allow=(None,))
        if mb is not None and pp != "auto":
            spec.check_microbatches(mb, pp)
        get_balancer(balancer)  # unknown names fail here, listing the valid ones
        if memory_capacity is not None and not memory_capacity > 0:
            raise ValueError(f"memory_capacity must be a positive number of bytes or None, got {memory_capacity!r}")
        link_bandwidth = check_link_bandwidth(link_bandwidth)
        if repack != "off":
            try:
                check_repack_target(repack)
            except ValueError:
                raise ValueError(f"repack must be 'off', 'auto' or a positive number of pipeline ranks, got {repack!r}") from None
        if not 0 <= repack_tolerance < 1:
            raise ValueError(f"repack_tolerance must be in [0, 1), got {repack_tolerance!r}")
        positive_int("plot_interval", plot_interval)
        if on_nonfinite not in NONFINITE_MODES:
            raise ValueError(
                f"on_nonfinite must be one of {', '.join(NONFINITE_MODES)} (what to do when a step's training loss "
                f"is NaN/Inf), got {on_nonfinite!r}"
            )
        activation_checkpointing = check_activation_checkpointing(activation_checkpointing, memory_capacity)
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False (torch.compile each pipeline layer), got {compile!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        out = cls(
            pipeline_parallel=pp, schedule=spec, virtual_stages=virtual, microbatches=mb, balancer=balancer,
            partition=Partition(tuple(partition)) if partition is not None else None,
            memory_capacity=memory_capacity, repack=repack, repack_tolerance=float(repack_tolerance),
            plot=bool(plot), plot_interval=plot_interval, on_nonfinite=on_nonfinite, timeout=timeout or DEFAULT_TIMEOUT, start_method=start_method,
            process_group_backend=process_group_backend, activation_checkpointing=activation_checkpointing,
            expert_parallel=expert_parallel, compile=compile, rebalance=rebalance,
            rebalance_interval=rebalance_interval, imbalance_threshold=imbalance_threshold,
            rebalance_horizon=rebalance_horizon, rebalance_cooldown=rebalance_cooldown,
            rebalance_hysteresis=rebalance_hysteresis, profile_steps=profile_steps, overhead_budget=overhead_budget,
            link_bandwidth=link_bandwidth,
        )
        out.policy(), out.budget()  # the policy's and the budget's own checks, once, here
        return out

    def policy(self) -> RebalancePolicy:
        """A fresh rebalance policy (its state starts empty) with these settings."""
        return RebalancePolicy(mode=self.rebalance, interval=self.rebalance_interval, threshold=self.imbalance_threshold,
                               horizon=self.rebalance_horizon, cooldown=self.rebalance_cooldown,
                               hysteresis=self.rebalance_hysteresis, profile_steps=self.profile_steps)

    def budget(self) -> OverheadBudget:
        """A fresh overhead budget over the last ``max(100, rebalance_horizon)`` steps."""
        return OverheadBudget(fraction=self.overhead_budget, window=max(100, self.rebalance_horizon))


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


def check_module(module, accumulate_grad_batches: int, num_stages: int, pipeline_parallel: int, virtual: int,
                 activation_checkpointing: bool | str = False, expert_parallel: int = 1) -> None:
    """What the pipeline needs of the LightningModule and the Trainer, checked at setup
    (any ``accumulate_grad_batches`` works: strategy/accumulation.py)."""
    check_expert_parallel_model(module, expert_parallel)
    if activation_checkpointing is not False:
        try:
            pipeline_layers_of(module)
        except PipelineProtocolError as err:
            raise PipelineProtocolError(
                f"activation_checkpointing={activation_checkpointing!r} checkpoints each pipeline layer, so the module "
                f"must expose its layers: {err}"
            ) from None
    if not module.automatic_optimization:
        raise PipelineProtocolError(
            "DynMoStrategy runs backward inside the pipeline schedule and needs automatic optimisation; "
            "set `self.automatic_optimization = True` in your LightningModule"
        )
    layers = pipeline_layers_of(module)
    in_layers = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in in_layers]
    if outside:
        raise PipelineProtocolError(
            f"{type(module).__name__} has parameters outside pipeline_layers(): {outside[:5]}; "
            "every parameter must be used by a pipeline layer (a parameter shared by several layers, like a "
            "tied embedding and LM head, is supported)"
        )
    check_stage_count(len(layers), num_stages, pipeline_parallel, virtual)


def check_stage_count(num_layers: int, num_stages: int, pipeline_parallel: int, virtual: int) -> None:
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages "
            f"(pipeline_parallel={pipeline_parallel} x virtual_stages={virtual}); "
            f"use at most {num_layers // virtual} pipeline ranks or a deeper model"
        )


# names a training_step may use for what the pipeline's own step already does (run the layers,
# compute pipeline_loss): such a training_step loses nothing when it is skipped
_PIPELINE_NAMES = {"pipeline_loss", "pipeline_layers", "forward", "training_step", "super", "layers",
                   "size", "shape", "view", "reshape", "flatten", "float", "long", "to", "mean", "detach", "item"}


def check_not_split(layers, rank: int) -> None:
    """A second ``fit`` on a module an earlier fit split across the pipeline is refused."""
    if any(isinstance(layer, RemoteLayer) for layer in layers):
        raise RuntimeError(
            f"rank {rank}: this module was already split across the pipeline by an earlier fit; "
            "its optimizer cannot be rebuilt from the local layers alone. Build a fresh module and resume with "
            "trainer.fit(model, ckpt_path=...) (checkpoints load under any partition)."
        )


def check_fit(module, layers, rank: int) -> None:
    """At the setup of a fit: refuse a module an earlier fit split, warn about a skipped training_step."""
    check_not_split(layers, rank)
    message = skipped_training_step_warning(module)
    if message:
        rank_zero_warn(message)


def skipped_training_step_warning(module) -> str | None:
    """The warning to give when ``module.training_step`` holds logic the pipeline will skip
    (None: it does not define one, or it defines ``on_pipeline_train_loss``, the documented hook
    for per-step logic under the pipeline)."""
    cls = type(module)
    step = getattr(cls, "training_step", None)
    if step is None or step is L.LightningModule.training_step or callable(getattr(module, "on_pipeline_train_loss", None)):
        return None
    calls = set()
    try:
        for ins in dis.get_instructions(step):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL") and isinstance(ins.argval, str):
                calls.add(ins.argval)
    except TypeError:
        pass
    if not calls - _PIPELINE_NAMES:
        return None  # only computes the loss, which the pipeline does itself
    noted = sorted(n for n in calls if n.startswith("log") or n in ("manual_backward", "optimizers", "toggle_optimizer"))
    what = f" (it calls {', '.join('self.' + n for n in noted)})" if noted else ""
    return (
        f"{cls.__name__}.training_step is not called under DynMoStrategy{what}: the pipeline runs "
        "pipeline_layers() and pipeline_loss() itself and logs train_loss. Move per-step logic such as "
        "self.log(...) into `def on_pipeline_train_loss(self, loss, batch, batch_idx)`, which the strategy calls "
        "on every rank with the step's loss (defining it also silences this warning)."
    )
