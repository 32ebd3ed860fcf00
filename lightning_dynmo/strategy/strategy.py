"""``DynMoStrategy``: Lightning's ParallelStrategy for pipeline (x data) parallel training.

How a training step runs (automatic optimisation, unchanged for the user):

1. ``training_step`` runs the whole pipeline schedule (forward *and* backward of every
   micro-batch) with ``torch.distributed.pipelining`` and returns the batch loss, which every
   rank learns with one scalar all-reduce. Lightning zeroes gradients between ``training_step``
   and ``backward``, so the pipeline's gradients are held aside until ``backward``.
2. ``backward`` restores them, averages them over data-parallel replicas and fires the usual
   ``on_before_backward``/``on_after_backward`` hooks.
3. Lightning clips (by the global norm across stages) and steps each rank's optimizer, which
   holds only the parameters of the layers that rank owns.

Between steps the partition may change: :meth:`rebalance_to` moves layers with their full state
and the next step builds new stages from cached shape metadata.
"""
from __future__ import annotations

import atexit
import logging
import warnings
import math
import time
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from ..runtime.engine import PipelineEngine, Placement, TensorSpec, discover_layer_specs
from ..plan.migration_plan import MigrationPlan
from ..runtime.migration import MigrationStats, execute_migration
from ..runtime.optimizer_layout import OptimizerLayout
from ..plan.partition import Partition
from ..runtime.gradients import add_pipeline_clipping
from ..runtime.profiler import PipelineProfiler, layer_memory_bytes
from ..plan.cost_model import CostModel, LayerCosts, imbalance
from ..plan.policy import RebalancePolicy
from ..plan.repack import RepackPlan, plan_repack
from ..protocol import PipelineProtocolError, RemoteLayer, layers_attribute_name, pipeline_layers_of, split_batch
from ..plan.schedules import get_schedule
from ..plan.topology import Topology
from ..runtime.groups import build_groups

log = logging.getLogger(__name__)
# Our epoch-level metrics are already all-reduced (identical on every rank); Lightning cannot
# know that and would recommend sync_dist=True, which would add a collective per logged value.
warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level.*")

DEFAULT_TIMEOUT = timedelta(minutes=10)


def _positive_int(name: str, value: Any, allow: tuple = ()) -> Any:
    if value in allow:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = f" or one of {list(allow)}" if allow else ""
        raise ValueError(f"{name} must be a positive integer{extra}, got {value!r}")
    return value


class DynMoStrategy(ParallelStrategy):
    """Pipeline-parallel training that keeps its stages balanced while the model changes.

    Args:
        pipeline_parallel: ranks per pipeline (``"auto"``: all processes form one pipeline).
            Data-parallel replicas = devices x num_nodes / pipeline_parallel.
        schedule: a ``torch.distributed.pipelining`` schedule by name (see
            :func:`lightning_dynmo.schedules.available_schedules`).
        microbatches: micro-batches per step; ``None`` picks the largest divisor of the batch
            size that is at most 4 x stages (and at least the stage count where the schedule
            needs it).
        virtual_stages: stages per rank for interleaved schedules (default 2).
        balancer: name of the balancer for the initial partition (and later rebalancing).
        partition: explicit initial boundaries, overriding ``balancer`` for step 0.
        rebalance: ``"never"``, ``"every_n"`` (every ``rebalance_interval`` steps),
            ``"on_event"`` (after ``request_rebalance``) or ``"auto"`` (when the busy-time
            imbalance exceeds ``imbalance_threshold`` and the predicted saving over
            ``rebalance_horizon`` steps exceeds the measured migration cost).
        memory_capacity: bytes a stage may hold (parameters, gradients, optimizer state and the
            activations in flight); balancers never exceed it. ``None``: unlimited.
        repack: ``"off"``, a target number of pipeline ranks, or ``"auto"``: after a rebalance,
            move the layers onto the fewest ranks whose balanced partition fits memory and whose
            predicted step time stays within ``repack_tolerance`` of the current one; the other
            ranks are released (they keep no layers and do no training compute).
        plot: save a pipeline timeline and stage-load PNG next to the logs at each rebalance.
        timeout: timeout of every collective; a dead or stuck rank makes the others fail.
        start_method: ``"popen"`` (re-run the script, like torchrun) or ``"spawn"``/``"fork"``.
    """

    strategy_name = "dynmo"

    def __init__(
        self,
        pipeline_parallel: int | Literal["auto"] = "auto",
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        balancer: str = "uniform",
        partition: tuple[int, ...] | list[int] | None = None,
        rebalance: str = "never",
        rebalance_interval: int = 50,
        imbalance_threshold: float = 0.1,
        rebalance_horizon: int = 100,
        rebalance_cooldown: int = 10,
        memory_capacity: float | None = None,
        repack: str | int = "off",
        repack_tolerance: float = 0.05,
        plot: bool = True,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._pp_request = _positive_int("pipeline_parallel", pipeline_parallel, allow=("auto",))
        self._schedule_spec = get_schedule(schedule)
        self._virtual = self._schedule_spec.virtual_stages(virtual_stages)
        self._microbatches = _positive_int("microbatches", microbatches, allow=(None,))
        if self._microbatches is not None and self._pp_request != "auto":
            self._schedule_spec.check_microbatches(self._microbatches, self._pp_request)
        from ..plan.balancers import get_balancer

        get_balancer(balancer)  # unknown names fail here, listing the valid ones
        self._balancer_name = balancer
        self._initial_partition = tuple(partition) if partition is not None else None
        self.policy = RebalancePolicy(
            mode=rebalance,
            interval=rebalance_interval,
            threshold=imbalance_threshold,
            horizon=rebalance_horizon,
            cooldown=rebalance_cooldown,
        )
        if memory_capacity is not None and not memory_capacity > 0:
            raise ValueError(f"memory_capacity must be a positive number of bytes or None, got {memory_capacity!r}")
        self._memory_capacity = memory_capacity
        if not (repack in ("off", "auto") or (isinstance(repack, int) and not isinstance(repack, bool) and repack >= 1)):
            raise ValueError(f"repack must be 'off', 'auto' or a positive number of pipeline ranks, got {repack!r}")
        if not 0 <= repack_tolerance < 1:
            raise ValueError(f"repack_tolerance must be in [0, 1), got {repack_tolerance!r}")
        self._repack = repack
        self._repack_tolerance = float(repack_tolerance)
        self._plot = bool(plot)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be popen, spawn, fork or forkserver, got {start_method!r}")
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        self._timeout = timeout or DEFAULT_TIMEOUT
        self._num_nodes = 1

        # runtime state (set in setup_environment / setup)
        self.topology: Topology | None = None
        self.pipeline_group: dist.ProcessGroup | None = None
        self.data_parallel_group: dist.ProcessGroup | None = None
        self._pp_groups: list = []
        self.partition: Partition | None = None
        self._layers: nn.ModuleList | None = None
        self._layers_attr = ""
        self._layout: OptimizerLayout | None = None
        self._engines: dict[tuple, PipelineEngine] = {}
        self._layer_specs: dict[tuple, list[TensorSpec]] = {}
        self._held_grads: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._last_step_end: float | None = None
        self.last_migration: MigrationStats | None = None
        self.rebalance_history: list[dict] = []
        self._profiler: PipelineProfiler | None = None
        self._profiling_reason: str | None = None
        self._decide_next = False
        self._rank_busy: list[float] = []
        self._rank_wall: list[float] = []
        self._known_costs: dict[int, tuple[float, float]] = {}
        self._migration_cost_estimate: float | None = None
        self._batch_checked = False
        self._active_pp: int | None = None
        self._repack_requested: int | str | None = None
        self._last_batch_size: int | None = None
        self._last_microbatches: int | None = None
        self.released_ranks: list[int] = []

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def pipeline_parallel(self) -> int:
        world = self.num_nodes * self.num_processes
        return world if self._pp_request == "auto" else self._pp_request

    @property
    def pp_size(self) -> int:
        """Ranks in the pipeline now (fewer than ``pipeline_parallel`` after re-packing)."""
        return self._active_pp or self.pipeline_parallel

    @property
    def released(self) -> bool:
        """True on a rank that re-packing took out of the pipeline (it holds no layers)."""
        return self.pp_rank >= self.pp_size

    @property
    def num_stages(self) -> int:
        return self.pp_size * self._virtual

    @property
    def schedule(self) -> str:
        return self._schedule_spec.name

    @property
    def pp_rank(self) -> int:
        return self.global_rank % self.pipeline_parallel

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.pipeline_parallel

    @property
    def is_distributed(self) -> bool:
        """Always: Lightning then injects a DistributedSampler (with our replica count and rank),
        which also gives every rank of a pipeline the same batch order."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        topo = Topology(self.num_nodes * self.num_processes, self.pipeline_parallel)
        return {"num_replicas": topo.dp, "rank": self.dp_rank}

    def _check_topology(self) -> Topology:
        return Topology(self.num_nodes * self.num_processes, self.pipeline_parallel)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._check_topology()  # fail in the launching process, before any worker starts
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _PipelineSpawnLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self.topology = self._check_topology()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        atexit.register(_destroy_process_group_at_exit)
        self.pipeline_group, self.data_parallel_group, self._pp_groups = build_groups(
            self.topology, self.global_rank, self._timeout
        )

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # layers are placed first, then each rank loads its own part

    # ------------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._validate_module(trainer, module)
        layers = pipeline_layers_of(module)
        self._layers, self._layers_attr = layers, layers_attribute_name(module, layers)
        self.model = self.precision_plugin.convert_module(self.model)

        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # Built once on the full model: every parameter's group and hyper-parameters are known
            # globally, so layers can later move between ranks and checkpoints stay portable.
            self.setup_optimizers(trainer)
            self._layout = OptimizerLayout.record(module, self.optimizers)
        self.partition = self._initial_partition_for(layers)
        self._place_layers()
        if fitting:
            OptimizerLayout.keep_only_local(module, self.optimizers)
        self.model_to_device()
        self._profiler = PipelineProfiler(self.root_device)
        self.setup_precision_plugin()
        add_pipeline_clipping(self.precision_plugin, self.pipeline_group, self._param_positions, lambda: not self.released)
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        rank_zero_info(
            f"dynmo: {self.topology.pp} pipeline ranks x {self.topology.dp} data-parallel replicas, "
            f"schedule={self.schedule}, stages={self.num_stages}, partition {self.partition} "
            f"(balancer={self._balancer_name})"
        )

    def _validate_module(self, trainer, module) -> None:
        if not module.automatic_optimization:
            raise PipelineProtocolError(
                "DynMoStrategy runs backward inside the pipeline schedule and needs automatic optimisation; "
                "set `self.automatic_optimization = True` in your LightningModule"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "DynMoStrategy does not support accumulate_grad_batches > 1: raise `microbatches` instead "
                "(the pipeline already accumulates gradients over micro-batches)"
            )
        layers = pipeline_layers_of(module)
        in_layers = {id(p) for p in layers.parameters()}
        outside = [n for n, p in module.named_parameters() if id(p) not in in_layers]
        if outside:
            raise PipelineProtocolError(
                f"{type(module).__name__} has parameters outside pipeline_layers(): {outside[:5]}; "
                "every parameter must belong to exactly one pipeline layer (no weight tying across layers)"
            )
        if self.num_stages > len(layers):
            raise ValueError(
                f"cannot split {len(layers)} layers into {self.num_stages} pipeline stages "
                f"(pipeline_parallel={self.pipeline_parallel} x virtual_stages={self._virtual}); "
                f"use at most {len(layers) // self._virtual} pipeline ranks or a deeper model"
            )

    def _initial_partition_for(self, layers: nn.ModuleList) -> Partition:
        if self._initial_partition is not None:
            p = Partition(self._initial_partition)
            if p.num_layers != len(layers) or p.num_stages != self.num_stages:
                raise ValueError(
                    f"partition {self._initial_partition} does not split {len(layers)} layers into "
                    f"{self.num_stages} stages"
                )
            return p
        from ..plan.balancers import BalanceProblem, get_balancer
        params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        problem = BalanceProblem(
            costs=LayerCosts.from_params(params),
            num_stages=self.num_stages,
            model=self._cost_model(),
            current=None,
        )
        return get_balancer(self._balancer_name)(problem).partition

    def _param_positions(self, optimizer) -> tuple[list[tuple[int, nn.Parameter]], int]:
        """This rank's parameters of ``optimizer`` with their single-process positions."""
        o = next(i for i, x in enumerate(self.optimizers) if getattr(x, "_optimizer", x) is optimizer)
        slots = self._layout.slots
        local = [(slots[n].index, p) for n, p in self.lightning_module.named_parameters()
                 if n in slots and slots[n].optimizer == o]
        return sorted(local, key=lambda t: t[0]), sum(len(g) for g in self._layout.group_indices[o])

    @property
    def layers(self) -> nn.ModuleList:
        """The module's layer list; entries this rank does not own are :class:`RemoteLayer`."""
        assert self._layers is not None, "layers are placed in setup()"
        return self._layers

    def rank_of_stage(self, stage: int) -> int:
        return self._schedule_spec.rank_of_stage(stage, self.pp_size)

    def local_layer_indices(self) -> list[int]:
        """Global indices of the layers this rank owns, in pipeline order."""
        assert self.partition is not None
        return [
            i
            for s in range(self.partition.num_stages)
            if self.rank_of_stage(s) == self.pp_rank
            for i in self.partition.layers_of(s)
        ]

    def _place_layers(self) -> None:
        """Keep this rank's layers; replace the others with placeholders (their memory is freed)."""
        assert self._layers is not None and self.partition is not None
        owner = [self.rank_of_stage(s) for s in self.partition.owner_map()]
        for i in range(len(self._layers)):
            if owner[i] != self.pp_rank and not isinstance(self._layers[i], RemoteLayer):
                self._layers[i] = RemoteLayer(i, owner=owner[i])

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ pipeline execution
    def _choose_microbatches(self, batch_size: int, pp: int | None = None) -> int:
        """Micro-batches for ``batch_size`` on ``pp`` pipeline ranks (default: now). Unless the user
        pinned the count, the largest divisor of the batch that is at most 4 x stages, so that
        after re-packing onto fewer ranks the micro-batches grow again."""
        pp = pp or self.pp_size
        S = pp * self._virtual
        if self._microbatches is not None:
            m = self._microbatches
            if batch_size % m:
                raise ValueError(
                    f"batch size {batch_size} is not divisible by microbatches={m}; choose a batch size that "
                    f"is a multiple of {m} or set microbatches to a divisor of {batch_size}"
                )
        else:
            candidates = [d for d in range(1, batch_size + 1) if batch_size % d == 0 and d <= 4 * S]
            valid = []
            for d in candidates:
                try:
                    self._schedule_spec.check_microbatches(d, pp)
                    valid.append(d)
                except ValueError:
                    pass
            if not valid:
                raise ValueError(
                    f"no micro-batch count divides batch size {batch_size} and suits schedule "
                    f"{self.schedule!r} with {pp} pipeline ranks; use a batch size that is a multiple of {pp}"
                )
            m = max(valid)
        self._schedule_spec.check_microbatches(m, pp)
        return m

    def _engine_for(self, inputs: torch.Tensor, train: bool) -> PipelineEngine:
        m = self._choose_microbatches(inputs.shape[0])
        if train:
            self._last_microbatches = m
        mb_shape = (inputs.shape[0] // m, *inputs.shape[1:])
        key = (train, mb_shape, inputs.dtype, m)
        engine = self._engines.get(key)
        if engine is None:
            placement = Placement(self._layers, self.partition, self._schedule_spec, self.pp_rank, self.pp_size,
                                  self.pipeline_group, self.root_device)
            spec_key = (mb_shape, inputs.dtype)
            if spec_key not in self._layer_specs:
                self._layer_specs[spec_key] = discover_layer_specs(placement, inputs[: mb_shape[0]])
            engine = PipelineEngine(
                placement,
                m,
                self.lightning_module.pipeline_loss,
                TensorSpec.of(inputs[: mb_shape[0]], requires_grad=False),
                self._layer_specs[spec_key],
            )
            self._engines[key] = engine
        return engine

    def invalidate_pipeline(self) -> None:
        """Forget built stages and shape metadata (call when layers change structure or grad-ness)."""
        self._engines.clear()
        self._layer_specs.clear()

    def _step_allreduce(self, losses: list[torch.Tensor] | None, busy: float, wall: float) -> torch.Tensor:
        """The one collective of every step: the mean batch loss plus, piggy-backed, whether any
        rank profiled layers in this step and every rank's busy and wall time. Afterwards all
        ranks hold identical numbers, so every later decision is the same everywhere."""
        topo = self.topology
        W = topo.world_size
        vec = torch.zeros(2 + 2 * W, dtype=torch.float64, device=self.root_device)
        if losses:
            vec[0] = torch.stack([l.detach().double() for l in losses]).mean().to(vec.device) / topo.dp
        vec[1] = 1.0 if self._profiling_reason else 0.0
        vec[2 + self.global_rank] = busy
        vec[2 + W + self.global_rank] = wall
        dist.all_reduce(vec)
        host = vec.cpu().tolist()
        self._decide_next = host[1] > 0
        # per pipeline rank: the slowest replica
        active = range(self.pp_size)
        self._rank_busy = [max(host[2 + d * topo.pp + r] for d in range(topo.dp)) for r in active]
        self._rank_wall = [max(host[2 + W + d * topo.pp + r] for d in range(topo.dp)) for r in active]
        return vec[0].float()

    @property
    def rank_busy_seconds(self) -> list[float]:
        """Compute seconds of each pipeline rank in the last step (slowest replica), same on every rank."""
        return list(self._rank_busy)

    @property
    def rank_wall_seconds(self) -> list[float]:
        """Pipeline-schedule wall seconds of each pipeline rank in the last step, same on every rank."""
        return list(self._rank_wall)

    def _local_params(self) -> list[nn.Parameter]:
        return [p for p in self.lightning_module.parameters()]

    def _check_same_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """First step only: every rank of a pipeline must see the same batch, or stage 0's inputs
        and the last stage's targets silently disagree."""
        self._batch_checked = True
        if self.pipeline_parallel == 1:
            return
        digest = torch.tensor(
            [float(inputs.double().sum()), float(targets.double().sum()), float(inputs.shape[0])],
            dtype=torch.float64,
            device=self.root_device,
        )
        lo, hi = digest.clone(), digest.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.pipeline_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.pipeline_group)
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"rank {self.global_rank}: the ranks of one pipeline received different batches. Every pipeline "
                "rank must load the same batch: use a sampler with a fixed seed (Lightning's DistributedSampler, "
                "which the Trainer injects by default, or `DataLoader(..., generator=torch.Generator().manual_seed(s))`)."
            )

    def training_step(self, *args: Any, **kwargs: Any):
        module = self.lightning_module
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = split_batch(batch)
        if not self._batch_checked:
            self._check_same_batch(inputs, targets)
        now = time.perf_counter()
        self._last_batch_size = int(inputs.shape[0])
        if self.released:
            return self._released_step(inputs)
        with self.precision_plugin.train_step_context():
            engine = self._engine_for(inputs, train=True)
            self._profiler.instrument(engine)
            for p in self._local_params():
                p.grad = None
            self._profiler.begin_step()
            losses = engine.run(inputs, targets, train=True)
            self._profiler.end_step()
        if self._profiling_reason:
            for i, ft in self._profiler.layer_times().items():
                self._known_costs[i] = ft
        # Lightning zeroes gradients between training_step and backward: keep ours aside.
        self._held_grads = [(p, p.grad) for p in self._local_params() if p.grad is not None]
        for p, _ in self._held_grads:
            p.grad = None
        busy = sum(self._profiler.busy_seconds().values())
        loss = self._step_allreduce(losses, busy, engine.last_step_seconds)
        self.policy.observe_busy(self._rank_busy)
        tokens = inputs.numel() * self.topology.dp
        bs = inputs.shape[0]
        module.log("train_loss", loss, prog_bar=True, on_step=True, batch_size=bs)
        if self._last_step_end is not None:
            dt = now - self._last_step_end
            if dt > 0:
                module.log("tokens_per_sec", tokens / dt, prog_bar=True, on_step=True, batch_size=bs)
        wall = max(self._rank_wall) if self._rank_wall else 0.0
        if wall > 0 and self.pp_size > 1:
            idle = 1.0 - sum(self._rank_busy) / (len(self._rank_busy) * wall)
            module.log("pipeline/idle_fraction", max(0.0, idle), on_step=True, batch_size=bs)
            module.log("pipeline/imbalance", imbalance(self._rank_busy), on_step=True, batch_size=bs)
        self._last_step_end = now
        return loss

    def _released_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """A released rank computes nothing; it only joins the step's world collective (which
        Lightning's loop and the other ranks' decisions rely on) and reports the shared loss."""
        self._held_grads = []
        loss = self._step_allreduce(None, 0.0, 0.0)
        self.lightning_module.log("train_loss", loss, prog_bar=True, on_step=True, batch_size=inputs.shape[0])
        return loss

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Gradients were computed by the pipeline schedule; restore them, average over replicas
        and run the usual backward hooks."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, g in self._held_grads:
            p.grad = g
        self._held_grads = []
        self._average_grads_over_replicas()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _average_grads_over_replicas(self) -> None:
        if self.topology.dp == 1:
            return
        grads = [p.grad for p in self._local_params() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.data_parallel_group)
        flat /= self.topology.dp
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def validation_step(self, *args: Any, **kwargs: Any):
        return self._eval_step("val", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        return self._eval_step("test", *args, **kwargs)

    def _eval_step(self, stage: str, *args: Any, **kwargs: Any):
        module = self.lightning_module
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = split_batch(batch)
        ctx = self.precision_plugin.val_step_context() if stage == "val" else self.precision_plugin.test_step_context()
        losses = None
        if not self.released:
            with ctx:
                engine = self._engine_for(inputs, train=False)
                losses = engine.run(inputs, targets, train=False)
        loss = self._share_eval_loss(losses)
        module.log(f"{stage}_loss", loss, prog_bar=True, on_step=False, on_epoch=True, batch_size=inputs.shape[0])
        ppl = self._perplexity_metric(stage)
        ppl.update(loss, weight=inputs.numel())
        module.log(f"{stage}_ppl", ppl, on_step=False, on_epoch=True, metric_attribute=f"_dynmo_{stage}_ppl")
        return loss

    def _share_eval_loss(self, losses: list[torch.Tensor] | None) -> torch.Tensor:
        value = torch.zeros((), dtype=torch.float32, device=self.root_device)
        if losses:
            value = torch.stack([l.detach().float() for l in losses]).mean().to(value.device) / self.topology.dp
        dist.all_reduce(value)
        return value

    def _perplexity_metric(self, stage: str):
        from ..metrics import PerplexityFromLoss

        attr = f"_{stage}_ppl_metric"
        metric = getattr(self, attr, None)
        if metric is None:
            metric = PerplexityFromLoss().to(self.root_device)
            setattr(self, attr, metric)
        return metric

    def predict_step(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("DynMoStrategy does not implement predict yet; use a single-device strategy")

    # ------------------------------------------------------------------ rebalancing
    def request_rebalance(self, reason: str = "requested") -> None:
        """Ask for a rebalance (Algorithm 1): the next step is profiled per layer, then balanced.
        Callbacks call this on every rank (callbacks run everywhere); a request seen by any rank
        is enough, because the decision to act is agreed in the step's collective."""
        self.policy.request(str(reason))

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        step = self.lightning_module.trainer.global_step
        if self._decide_next:
            self._decide_next = False
            self._profiler.stop_layer_profiling()
            self._rebalance_from_profile(step, self._profiling_reason or "peer request")
            self._profiling_reason = None
        reason = self.policy.profile_reason(step)
        if reason:
            self._profiling_reason = reason
            self._profiler.start_layer_profiling(self._layers, self.local_layer_indices())
        else:
            self._profiling_reason = None

    def _cost_model(self) -> CostModel:
        """The cost model for this run. Every partition stage is one (virtual) stage; interleaved
        and looped schedules are modelled as 1F1B over the virtual stages."""
        cost_schedule = {"gpipe": "gpipe", "zero_bubble": "zero_bubble", "zbv": "zero_bubble"}.get(self.schedule, "1f1b")
        m = self._last_microbatches or self._microbatches or 4 * self.num_stages
        return CostModel(microbatches=m, schedule=cost_schedule, capacity=self._memory_capacity)

    def gather_layer_costs(self) -> tuple[LayerCosts, list[dict]]:
        """Per-layer costs identical on every rank (collective over the world). Data-parallel
        replicas may measure different times (different data): each layer takes its slowest
        replica's time, because the slowest replica sets the step time. Returns the costs and the
        chunk timeline of the last step of every rank (for plots)."""
        local = {}
        for i in self.local_layer_indices():
            layer = self._layers[i]
            f, b = self._known_costs.get(i, (math.nan, math.nan))
            params = sum(p.numel() for p in layer.parameters())
            local[i] = (f, b, params, layer_memory_bytes(layer, self.optimizers))
        events = [
            {"rank": self.global_rank, "stage": e.stage, "kind": e.kind, "mb": e.microbatch, "start": e.start, "end": e.end}
            for e in self._profiler.events
        ]
        parts: list = [None] * self.topology.world_size
        dist.all_gather_object(parts, (local, events))
        merged: dict[int, list] = {}
        all_events: list[dict] = []
        for part, ev in parts:
            all_events.extend(ev)
            for i, (f, b, n, mem) in part.items():
                if i not in merged:
                    merged[i] = [f, b, n, mem]
                else:
                    cur = merged[i]
                    cur[0] = max(cur[0], f) if not math.isnan(f) else cur[0]
                    cur[1] = max(cur[1], b) if not math.isnan(b) else cur[1]
                    cur[3] = max(cur[3], mem)
        L = len(self._layers)
        fwd = [merged[i][0] for i in range(L)]
        bwd = [merged[i][1] for i in range(L)]
        params = [int(merged[i][2]) for i in range(L)]
        memory = [float(merged[i][3]) for i in range(L)]
        measured = [i for i in range(L) if not math.isnan(fwd[i]) and params[i] > 0]
        per_param = (
            sum(fwd[i] + bwd[i] for i in measured) / max(1, sum(params[i] for i in measured)) if measured else 3e-9
        )
        for i in range(L):  # a layer nobody timed yet: estimate from its size (DeepSpeed's proxy)
            if math.isnan(fwd[i]) or math.isnan(bwd[i]):
                fwd[i], bwd[i] = params[i] * per_param / 3, 2 * params[i] * per_param / 3
        specs = next(iter(self._layer_specs.values()), None)
        activation = [float(sp.nbytes) for sp in specs] if specs else [0.0] * L
        return LayerCosts(tuple(fwd), tuple(bwd), tuple(params), tuple(memory), tuple(activation)), all_events

    def _rebalance_from_profile(self, step: int, reason: str) -> None:
        """Algorithm 1: balance on the profiled costs, migrate, then (optionally) re-pack."""
        t0 = time.perf_counter()
        costs, events = self.gather_layer_costs()
        self._rebalance_decision(step, reason, costs, events, t0)
        target = self._repack_requested if self._repack_requested is not None else self._repack
        self._repack_requested = None
        if target != "off" and self.pp_size > 1:
            self._consider_repack(step, target, costs)

    def _rebalance_decision(self, step: int, reason: str, costs, events, t0: float) -> None:
        from ..plan.balancers import BalanceProblem, InfeasiblePartitionError, get_balancer

        model = self._cost_model()
        before = self.partition
        record: dict[str, Any] = {"step": step, "reason": reason, "balancer": self._balancer_name, "before": str(before)}
        try:
            result = get_balancer(self._balancer_name)(
                BalanceProblem(costs=costs, num_stages=self.num_stages, model=model, current=before)
            )
        except InfeasiblePartitionError as err:
            record.update(applied=False, why=f"refused: {err}")
            self._record_rebalance(record, costs, model, events, before, None)
            return
        decide_s = time.perf_counter() - t0
        pred_now = model.predicted_step_time(costs, before)
        pred_new = model.predicted_step_time(costs, result.partition)
        cost = self._migration_cost_estimate
        if cost is None:
            cost = max(self._rank_wall) if self._rank_wall else 0.0  # first time: assume one step
        accept, why = self.policy.accept(pred_now, pred_new, cost)
        record.update(
            after=str(result.partition),
            rounds=result.rounds,
            decision_ms=decide_s * 1e3,
            predicted_step_before=pred_now,
            predicted_step_after=pred_new,
            imbalance_before=imbalance(model.stage_times(costs, before)),
            imbalance_after=imbalance(model.stage_times(costs, result.partition)),
            bubble_before=model.bubble_fraction(costs, before),
            bubble_after=model.bubble_fraction(costs, result.partition),
        )
        if result.partition == before or not accept:
            record.update(applied=False, why="already balanced" if result.partition == before else why)
            self._record_rebalance(record, costs, model, events, before, None)
            return
        stats = self.rebalance_to(result.partition)
        agreed = torch.tensor([stats.seconds, float(stats.bytes_sent)], dtype=torch.float64, device=self.root_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        moved_bytes = torch.tensor([float(stats.bytes_sent)], dtype=torch.float64, device=self.root_device)
        dist.all_reduce(moved_bytes)
        self._migration_cost_estimate = float(agreed[0]) + decide_s
        self.policy.applied(step)
        record.update(
            applied=True,
            why=why,
            migration_ms=float(agreed[0]) * 1e3,
            migration_bytes=int(moved_bytes.item()),
            moved_layers=before.moved_layers(result.partition),
        )
        self._record_rebalance(record, costs, model, events, before, result.partition)

    # ------------------------------------------------------------------ re-packing
    def request_repack(self, target: int | str = "auto") -> None:
        """Ask to pack the pipeline onto ``target`` ranks (or ``"auto"``): the next step is
        profiled, balanced, and then packed. Call on every rank, like ``request_rebalance``."""
        if not (target == "auto" or (isinstance(target, int) and not isinstance(target, bool) and target >= 1)):
            raise ValueError(f"repack target must be 'auto' or a positive number of pipeline ranks, got {target!r}")
        self._repack_requested = target
        self.policy.request(f"repack to {target}")

    def plan_repack(self, costs: LayerCosts, target: int | str) -> RepackPlan | str:
        """What :func:`lightning_dynmo.repack.plan_repack` decides for this run's state."""
        if self._last_batch_size is None or self._last_microbatches is None:
            return "no step has run yet"
        return plan_repack(
            costs, self.partition, self._cost_model(), self.pp_size, target, self._balancer_name,
            lambda r: self._choose_microbatches(self._last_batch_size, pp=r), self._virtual, self._repack_tolerance,
        )

    def _consider_repack(self, step: int, target: int | str, costs) -> None:
        before_ranks, before = self.pp_size, self.partition
        plan = self.plan_repack(costs, target)
        record: dict[str, Any] = {"step": step, "reason": f"repack {target}", "kind": "repack", "before": str(before),
                                  "ranks_before": before_ranks}
        if isinstance(plan, str):
            record.update(applied=False, why=f"refused: {plan}")
            self._record_rebalance(record, costs, self._cost_model(), [], before, None)
            return
        ranks, partition, m, pred = plan.ranks, plan.partition, plan.microbatches, plan.predicted_step
        t0 = time.perf_counter()
        released = self.repack_to(ranks, partition)
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.root_device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        self.policy.applied(step)
        record.update(applied=True, after=str(partition), ranks_after=ranks, microbatches=m, released=released,
                      predicted_step_after=pred, migration_ms=float(seconds) * 1e3, why=f"packed {before_ranks} -> {ranks}")
        self._record_rebalance(record, costs, self._cost_model(), [], before, None)

    def repack_to(self, ranks: int, partition: Partition | tuple[int, ...] | list[int]) -> list[int]:
        """Move every layer (with its state) onto the first ``ranks`` pipeline ranks of each
        replica, rebuild the pipeline groups on them and release the others. Collective over the
        world: every rank calls it with the same arguments. Returns the released global ranks."""
        partition = partition if isinstance(partition, Partition) else Partition(tuple(partition))
        if not 1 <= ranks < self.pp_size:
            raise ValueError(f"can only pack {self.pp_size} pipeline ranks onto 1..{self.pp_size - 1}, got {ranks}")
        if partition.num_stages != ranks * self._virtual or partition.num_layers != len(self._layers):
            raise ValueError(f"partition {partition} does not split {len(self._layers)} layers into {ranks * self._virtual} stages")
        spec = self._schedule_spec
        plan = MigrationPlan.build(self.partition, partition, self.rank_of_stage, lambda s: spec.rank_of_stage(s, ranks))
        self._profiler.stop_layer_profiling()
        self._engines.clear()
        if not self.released:
            stats = execute_migration(plan, self.lightning_module, self._layers, self._layers_attr, self.optimizers,
                                      self._layout, self.pp_rank, self.pipeline_group, self.root_device)
            self.last_migration = stats
        topo = self.topology
        # every world rank creates every replica's new group, in the same order
        groups = [dist.new_group([d * topo.pp + k for k in range(ranks)], timeout=self._timeout) for d in range(topo.dp)]
        self._active_pp = ranks
        self.partition = partition
        self._pp_groups = groups
        self.pipeline_group = groups[self.dp_rank] if not self.released else None
        self.precision_plugin._dynmo_pipeline_group = self.pipeline_group
        released = [d * topo.pp + k for d in range(topo.dp) for k in range(ranks, topo.pp)]
        self.released_ranks = released
        if self.released:
            self._layer_specs.clear()
            if self.root_device.type == "cuda":
                torch.cuda.empty_cache()
        self._notify_released(released)
        return released

    def _notify_released(self, released: list[int]) -> None:
        """Tell the launcher/scheduler: ``on_workers_released(ranks)`` on the LightningModule and
        on every callback that defines it, plus a log line and a metric."""
        module = self.lightning_module
        trainer = module.trainer
        for obj in [module, *trainer.callbacks]:
            hook = getattr(obj, "on_workers_released", None)
            if callable(hook):
                hook(released)
        module.log("pipeline/ranks", float(self.pp_size), on_step=True, on_epoch=False, batch_size=1)
        rank_zero_info(f"dynmo: packed onto {self.pp_size} pipeline ranks per replica; released ranks {released}")

    def _record_rebalance(
        self, record: dict, costs, model, events: list[dict], before: Partition, new: Partition | None
    ) -> None:
        """Log a rebalance decision: metrics to the Lightning loggers, a JSON line and plots."""
        self.rebalance_history.append(record)
        module = self.lightning_module
        for key in ("decision_ms", "migration_ms", "migration_bytes", "imbalance_before", "imbalance_after",
                    "bubble_before", "bubble_after", "predicted_step_before", "predicted_step_after"):
            if key in record:
                module.log(f"rebalance/{key}", float(record[key]), on_step=True, on_epoch=False, batch_size=1)
        for s, b in enumerate(self.partition.boundaries[1:-1], start=1):
            module.log(f"partition/b{s}", float(b), on_step=True, on_epoch=False, batch_size=1)
        out_dir = self._output_dir()  # collective (Trainer.log_dir broadcasts): every rank calls it
        if not self.is_global_zero:
            return
        rank_zero_info(
            f"dynmo rebalance @ step {record['step']} ({record['reason']}): {record['before']} -> "
            f"{record.get('after', record['before'])} applied={record['applied']} ({record.get('why', '')})"
        )
        if out_dir is None:
            return
        import json
        import os

        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "rebalance_history.jsonl"), "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._plot and events:
            from ..plotting import save_rebalance_figure

            save_rebalance_figure(
                os.path.join(out_dir, f"rebalance_step{record['step']:06d}.png"),
                events,
                before=(str(before), model.stage_times(costs, before)),
                after=(str(new), model.stage_times(costs, new)) if new is not None else None,
                title=f"step {record['step']}: {record['reason']}",
            )

    def _output_dir(self) -> str | None:
        """Where logs go (``Trainer.log_dir`` is a broadcast: call on every rank)."""
        trainer = self.lightning_module.trainer
        return trainer.log_dir or trainer.default_root_dir

    def rebalance_to(self, new: Partition | tuple[int, ...] | list[int]) -> MigrationStats:
        """Move layers (with all their state) so that ``new`` becomes the partition. Collective:
        every pipeline rank of every replica must call it with the same partition."""
        new = new if isinstance(new, Partition) else Partition(tuple(new))
        assert self.partition is not None and self._layers is not None
        if new.num_layers != self.partition.num_layers or new.num_stages != self.partition.num_stages:
            raise ValueError(
                f"partition {new} must split {self.partition.num_layers} layers into {self.partition.num_stages} stages"
            )
        if self.released:  # not in the pipeline group: nothing to send or receive
            self.partition = new
            return MigrationStats()
        plan = MigrationPlan.build(self.partition, new, self.rank_of_stage)
        if self._profiler is not None:
            self._profiler.stop_layer_profiling()  # hooks must not travel with the layers
        self._engines.clear()  # release stage references to layers that may leave
        stats = execute_migration(
            plan,
            self.lightning_module,
            self._layers,
            self._layers_attr,
            self.optimizers,
            self._layout,
            self.pp_rank,
            self.pipeline_group,
            self.root_device,
        )
        self.partition = new
        self.last_migration = stats
        log.debug("rank %d migrated: %s", self.global_rank, plan.describe())
        return stats

    # ------------------------------------------------------------------ checkpoints
    def _gather_to_zero(self, obj: Any) -> list[Any] | None:
        """Gather ``obj`` from replica 0's pipeline ranks onto global rank 0."""
        if self.dp_rank != 0:
            return None
        if self.released:
            return None
        if self.pp_size == 1:
            return [obj]
        group = self._pp_groups[0]
        out = [None] * self.pp_size if self.global_rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=group)
        return out

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict (global layer indices) on rank 0; empty elsewhere."""
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        parts = self._gather_to_zero(local)
        if not parts:
            return {}
        full: dict[str, Any] = {}
        for part in parts:
            full.update(part)
        return full

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer state in single-process format (any partition can load it), on rank 0."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        o = next(i for i, x in enumerate(self.optimizers) if getattr(x, "_optimizer", x) is opt)
        states = self._layout.local_states(self.lightning_module, self.optimizers, o)
        parts = self._gather_to_zero(states)
        if not parts:
            return {}
        merged: dict[str, dict] = {}
        for part in parts:
            merged.update(part)
        return self._layout.global_state_dict(opt, o, merged)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        module = self.lightning_module
        own = module.state_dict()
        missing = [k for k in own if k not in checkpoint["state_dict"]]
        if missing and strict:
            raise KeyError(f"checkpoint lacks {len(missing)} entries this rank needs, e.g. {missing[:3]}")
        module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k in own}, strict=False)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"checkpoint has {len(states)} optimizers, the module configures {len(self.optimizers)}")
        for o, (opt, sd) in enumerate(zip(self.optimizers, states)):
            self._layout.load_local(self.lightning_module, opt, o, sd)
        _optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------------ collectives
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "dynmo", cls, description="lightning_dynmo: pipeline parallel with live rebalancing", override=True
        )
        strategy_registry.register(
            "dynmo_spawn", cls, description="lightning_dynmo with spawned processes", start_method="spawn", override=True
        )


def _destroy_process_group_at_exit() -> None:
    """Tear the process group down before interpreter shutdown: left to static destructors, gloo's
    worker threads can outlive Python and abort the process ("terminate called without an active
    exception") after a successful run."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class _PipelineSpawnLauncher(_MultiProcessingLauncher):
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


DynMoStrategy.register_strategies(StrategyRegistry)
