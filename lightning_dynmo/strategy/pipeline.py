"""This rank's pipeline: where the layers live, the runtime objects that run them, and what users,
callbacks and benchmarks ask of it (``trainer.strategy.pipeline``, a
:class:`~lightning_dynmo.protocol.PipelineControl`).

:class:`~lightning_dynmo.strategy.strategy.DynMoStrategy` keeps Lightning's hooks; each hook hands
the work to this object. The pipeline reads Lightning's side of the run (the module, its
optimizers, the device and the ranks) from its :class:`LightningSide`, which it never writes. The
rebalancer and the checkpoint functions get the pipeline as a value (:meth:`Pipeline.snapshot`) and
hand back a new layout (:class:`~lightning_dynmo.strategy.state.Relayout`), which only
:meth:`Pipeline.adopt` assigns.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from ..plan.cost_model import LayerCosts
from ..plan.layout import PipelineLayout
from ..plan.measurements import KnownWork
from ..plan.partition import Partition
from ..plan.schedules import choose_microbatches
from ..plan.topology import Topology
from ..protocol import layers_attribute_name, pipeline_layers_of, split_batch
from ..runtime.compile import compile_local_layers
from ..runtime.dp_sharding import Fsdp, Replicate
from ..runtime.engine import EngineCache, raise_step_problem
from ..runtime.expert_parallel import ExpertParallel, ExpertShards, check_expert_parallel
from ..runtime.fsdp import ShardedLayers, check_expert_shard_optimizers, check_fsdp_composition, dp_mesh
from ..runtime.gradients import HeldGradients
from ..runtime.groups import PipelineGroups, groups_of_layout
from ..runtime.memory import layer_state_bytes
from ..runtime.migration import MigrationStats
from ..runtime.optimizer_layout import OptimizerLayout
from ..runtime.placement import Placement, collect_load_factors, place_local_layers
from ..runtime.precision import pipeline_loss_fn, unscale_losses
from ..runtime.profiler import PipelineProfiler
from ..runtime.recompute import ActivationCheckpointing
from ..runtime.step_stats import exchange_step_stats
from ..runtime.tied import TiedParameters, find_tied_parameters
from . import checkpoint
from .accumulation import AccumulationWindow
from .nonfinite import check_loss
from .options import DpSharding, PipelineOptions
from .partial_batch import BatchSizes
from .rebalancer import Rebalancer
from .recorder import dynmo_summary_text, log_step, notify_released
from .setup_checks import check_module, shared_cores_message
from .state import RankPipeline, Relayout, output_dir
from .step_guard import check_before_run, check_closure_optimizers
from .token_weights import TokenWeights


class LightningSide(Protocol):
    """What the pipeline reads of its Lightning strategy (and never writes)."""

    lightning_module: Any
    optimizers: list
    root_device: torch.device
    global_rank: int
    num_nodes: int
    num_processes: int

    def agree(self, name: str, flag: float = 0.0) -> Any: ...


class Pipeline:
    """This rank's share of the pipeline and the rebalancing API. Built empty with the strategy;
    :meth:`connect` (process groups up) and :meth:`place` (layers on their ranks) fill it in."""

    def __init__(self, options: PipelineOptions, lightning: LightningSide) -> None:
        self.options = options
        self._lightning = lightning
        self.known_work = KnownWork()  # per-layer work: the rebalancer measures it, recomputation reads it
        self.rebalancer = Rebalancer(options, self.known_work)
        self.layout: PipelineLayout | None = None  # replaced (never changed in place) when layers move
        self.groups = PipelineGroups()
        self.expert_parallel: ExpertParallel | None = None  # this rank's expert shard (expert_parallel > 1)
        self.dp_sharding: Replicate = Replicate()  # how stages are held over their replicas (set in place)
        self.tied = TiedParameters([])  # parameters shared by several layers
        self.optimizer_layout: OptimizerLayout | None = None
        self.full_state_shapes: dict[str, tuple[int, ...]] = {}  # the whole model's state-dict shapes
        self.profiler: PipelineProfiler | None = None
        self.engines: EngineCache | None = None
        self.window = AccumulationWindow()  # accumulate_grad_batches (strategy/accumulation.py)
        self.last_batch_size: int | None = None
        self.last_microbatches: int | None = None
        self._layers: nn.ModuleList | None = None
        self._layers_attr = ""
        self._batch_sizes = BatchSizes(options)
        self._token_weights = TokenWeights(None)
        self._held_grads = HeldGradients()
        self._last_step_end: float | None = None

    # ------------------------------------------------------------------ Lightning's side, read through
    lightning_module = property(lambda self: self._lightning.lightning_module)
    optimizers = property(lambda self: self._lightning.optimizers)
    root_device = property(lambda self: self._lightning.root_device)
    global_rank = property(lambda self: self._lightning.global_rank)

    # ------------------------------------------------------------------ geometry and state (read-only)
    schedule = property(lambda self: self.options.schedule.name)
    topology = property(lambda self: self.layout.topology if self.layout else None)
    partition = property(lambda self: self.layout.partition if self.layout else None)
    pipeline_group = property(lambda self: self.groups.pipeline, doc="This rank's pipeline group (None: the world).")
    data_parallel_group = property(lambda self: self.groups.data_parallel)
    released = property(lambda self: self.layout.released, doc="True on a rank re-packing released (no layers).")
    layers_attr = property(lambda self: self._layers_attr, doc="Attribute name of the layer list on the module.")

    @property
    def pipeline_parallel(self) -> int:
        pp = self.options.pipeline_parallel
        return self._lightning.num_nodes * self._lightning.num_processes if pp == "auto" else pp

    @property
    def layers(self) -> nn.ModuleList:
        """The module's layer list; entries this rank does not own are :class:`RemoteLayer`."""
        assert self._layers is not None, "layers are placed in setup()"
        return self._layers

    def local_layer_indices(self) -> list[int]:
        """Global indices of the layers this rank owns, in pipeline order."""
        return self.layout.local_layer_indices()

    def choose_microbatches(self, batch_size: int, pp: int | None = None) -> int:
        """Micro-batches for ``batch_size`` on ``pp`` pipeline ranks (default: now)."""
        return choose_microbatches(self.options.schedule, batch_size, pp or self.layout.pp_size,
                                   self.options.virtual_stages, self.options.microbatches)

    def world_topology(self) -> Topology:
        """The topology the world's size and ``pipeline_parallel`` make (checked, before any layout)."""
        side = self._lightning
        topo = Topology(side.num_nodes * side.num_processes, self.pipeline_parallel,
                        ranks_per_node=side.num_processes or None)
        check_expert_parallel(self.options.expert_parallel, topo.dp)
        return topo

    def expert_shards(self) -> ExpertShards | None:
        """This rank's expert-shard parameters and groups (None without expert parallelism)."""
        return self.expert_parallel.shards(self._lightning.lightning_module) if self.expert_parallel else None

    def invalidate_pipeline(self) -> None:
        """Forget built stages and shape metadata (call when layers change structure or grad-ness).
        Safe on any subset of ranks: the next training step rebuilds every rank's stages."""
        self.engines.clear()

    def last_step_events(self) -> list[dict]:
        """This rank's chunk timeline of the last step (for plots and the simulator)."""
        return self.profiler.event_dicts(self._lightning.global_rank)

    rank_busy_seconds = property(lambda self: list(self.rebalancer.rank_busy),
                                 doc="Compute seconds of each pipeline rank in the last step (slowest replica).")
    rank_wall_seconds = property(lambda self: list(self.rebalancer.rank_wall),
                                 doc="Pipeline-schedule wall seconds of each pipeline rank in the last step.")
    layer_load = property(lambda self: list(self.rebalancer.layer_load),
                          doc="Each layer's load factor in the last step (layers implementing ReportsLoad).")

    @property
    def dynmo_summary(self) -> dict:
        """Measured overhead (profiling, decisions, migrations) and step time after vs before
        each applied decision (same on every rank)."""
        return self.rebalancer.summary()

    @property
    def rebalance_history(self) -> list[dict]:
        """Every decision so far as its JSON record (the lines of ``rebalance_history.jsonl``)."""
        return [d.to_record() for d in self.rebalancer.recorder.decisions]

    @property
    def released_ranks(self) -> list[int]:
        """Global ranks re-packing has released so far (empty before any packing)."""
        return list(self.layout.released_ranks) if self.layout is not None else []

    def output_dir(self) -> str | None:
        """Where logs go (``Trainer.log_dir`` is a broadcast: call on every rank)."""
        return output_dir(self._lightning.lightning_module.trainer)

    # ------------------------------------------------------------------ rebalancing (public API)
    def request_rebalance(self, reason: str = "requested", reprofile: bool = True) -> None:
        """Ask for a rebalance (Algorithm 1): the next step is profiled per layer, then balanced.
        With ``reprofile=False`` (routing changed, not what layers compute) the next step decides
        from the last profile scaled by the layers' load factors, without profiling, when layers
        report their load (see :class:`~lightning_dynmo.protocol.ReportsLoad`). Callbacks call
        this on every rank (callbacks run everywhere); the decision to act is agreed in the
        step's collective."""
        self.rebalancer.request_rebalance(reason, reprofile)

    def request_repack(self, target: int | str = "auto") -> None:
        """Ask to pack the pipeline onto ``target`` ranks (or ``"auto"``): the next step is
        profiled and then packed, under any ``rebalance`` mode. A request made on some ranks only
        acts on all of them (agreed at the decision, see strategy/requests.py)."""
        self.rebalancer.request_repack(target)

    def gather_layer_costs(self) -> tuple[LayerCosts, list[dict]]:
        """Per-layer costs identical on every rank, plus every rank's last chunk timeline. Collective."""
        return self.rebalancer.gather_layer_costs(self.snapshot())

    def rebalance_to(self, new: Partition | tuple[int, ...] | list[int]) -> MigrationStats:
        """Move layers (with all their state) so that ``new`` becomes the partition. Collective:
        every pipeline rank of every replica must call it with the same partition."""
        target = new if isinstance(new, Partition) else Partition(tuple(new))
        change = self.rebalancer.rebalance_to(target, self.snapshot())
        self.adopt(change)
        return change.migration if change.migration is not None else MigrationStats()

    def repack_to(self, ranks: int, partition: Partition | tuple[int, ...] | list[int]) -> list[int]:
        """Move every layer (with its state) onto the first ``ranks`` pipeline ranks of each
        replica, rebuild the pipeline groups on them and release the others. Collective over the
        world: every rank calls it with the same arguments. Returns the released global ranks."""
        partition = partition if isinstance(partition, Partition) else Partition(tuple(partition))
        change, _, _ = self.rebalancer.migrate(partition, self.snapshot(), ranks=ranks)
        self.adopt(change)
        return self.released_ranks

    # ------------------------------------------------------------------ the value handed to helpers
    def snapshot(self) -> RankPipeline:
        """This rank's pipeline as one value: what the rebalancer and checkpoints may read."""
        side = self._lightning
        return RankPipeline(side.lightning_module, self._layers, self._layers_attr, side.optimizers,
                            self.optimizer_layout, self.tied, self.profiler, self.engines, self.expert_parallel,
                            self.full_state_shapes, self.layout, self.groups, side.root_device, side.global_rank,
                            self.last_batch_size, self.last_microbatches, self.window.k, self.dp_sharding)

    def adopt(self, change: Relayout | None) -> None:
        """A migration's new layout (and, after re-packing, groups) becomes this rank's; the module
        and callbacks hear which ranks a re-pack released once the pipeline shows it."""
        if change is None:
            return
        self.layout = change.layout
        if change.groups is not None:
            self.groups = change.groups
            notify_released(self._lightning.lightning_module, self.layout.pp_size, self.layout.released_ranks)

    # ------------------------------------------------------------------ building it
    def connect(self, global_rank: int, timeout) -> None:
        """Once the process group is up: the layout (kept by a later trainer stage, such as a test
        after fit: the layers stay where they now live), the process groups and the expert shard."""
        o = self.options
        if self.layout is None:
            self.layout = PipelineLayout(self.world_topology(), o.schedule, o.virtual_stages, global_rank)
        self.groups = groups_of_layout(self.layout, global_rank, timeout)
        self.expert_parallel = ExpertParallel.build(self.layout.topology, o.expert_parallel, global_rank, timeout)

    def take_module(self, module, precision_plugin) -> None:
        """The module's layer list and tied parameters, checked against the pipeline's shape (and,
        under fsdp, against what FSDP units can hold) on every rank before anything moves."""
        check_module(module, self.layout.num_stages, self.pipeline_parallel, self.options.virtual_stages,
                     self.options.activation_checkpointing, self.options.expert_parallel)
        layers = pipeline_layers_of(module)
        self._layers, self._layers_attr = layers, layers_attribute_name(module, layers)
        self.tied = TiedParameters(find_tied_parameters(layers, self._layers_attr))
        if self._shards_replicas():
            check_fsdp_composition(precision=str(precision_plugin.precision))

    def _shards_replicas(self) -> bool:
        return self.options.dp_sharding is DpSharding.FSDP and self.topology.dp > 1  # (one replica: nothing to shard)

    def place(self, trainer, fitting: bool) -> None:
        """With the optimizers built (fit): record them, choose the partition and put this rank's
        layers on its device (each an FSDP unit under fsdp); the engines come last."""
        side = self._lightning
        module, layers, device, rank = side.lightning_module, self.layers, side.root_device, side.global_rank
        fsdp = self._shards_replicas()
        self.full_state_shapes = checkpoint.whole_model_state_shapes(module)
        if fitting:
            # Built once on the full model: every parameter's group and hyper-parameters are known
            # globally, so layers can later move between ranks and checkpoints stay portable.
            self.optimizer_layout = OptimizerLayout.record(module, side.optimizers, self.tied.aliases)
            check_closure_optimizers(side.optimizers, rank)
            if fsdp and self.expert_parallel is not None:
                check_expert_shard_optimizers(side.optimizers, device)
            if self.options.rank_speeds is True:  # measured only where ranks have cores of their own
                why = shared_cores_message(device, side.num_processes)
                if side.agree("setup: can every rank measure its speed", float(why is not None)):
                    rank_zero_warn(why or "rank_speeds=True is turned off: ranks on another node share CPU cores")
                    self.options = dataclasses.replace(self.options, rank_speeds=False)
                    self.rebalancer.options = self.options
        optimizers = side.optimizers if fitting else ()
        if self.layout.partition is None:
            self.layout = self.layout.with_partition(self.rebalancer.initial_partition(
                layers, self.layout, device, rank, self.last_microbatches, optimizers, self.topology.dp if fsdp else 1))
        if fsdp:  # each local layer an FSDP unit over this stage's replicas (runtime/fsdp.py)
            self.dp_sharding = Fsdp(ShardedLayers(dp_mesh(self.data_parallel_group, device), layers,
                                                  self._layers_attr, module, optimizers, self.optimizer_layout,
                                                  expert_parallel=self.expert_parallel, tied=self.tied))
        # built on the meta device: each layer is allocated as its shards where the model can fill them,
        # else sharded as soon as it is allocated (never the whole stage)
        place_local_layers(module, layers, self.layout, rank, self.tied, self.options.timeout, optimizers,
                           self.optimizer_layout, self.expert_parallel,
                           after_materialize=lambda i: self.dp_sharding.shard([i]),
                           materialize_in_shards=lambda i: self.dp_sharding.materialize_in_shards(module, i, device))
        if self.topology.dp == 1:
            # One replica: every rank already loads the same batches; Lightning's injected
            # DistributedSampler would reshuffle a shuffle=False loader (it forces shuffle=True).
            trainer._accelerator_connector.use_distributed_sampler = False
        module.to(device)
        self.tied.align(layers, optimizers)  # tied copies: one object per rank, equal values
        self.dp_sharding.shard(self.local_layer_indices())  # (fsdp: layers built whole are sharded on their device)
        self.profiler = PipelineProfiler(device)
        self._token_weights = TokenWeights.of(module)
        self.engines = EngineCache(self.profiler, ActivationCheckpointing(
            self.options.activation_checkpointing, self.options.memory_capacity,
            lambda i: layer_state_bytes(layers[i], side.optimizers), self.known_work.forward),
            wrap_stage=self.dp_sharding.wrap_stage)

    def describe(self) -> str:
        return (f"dynmo: {self.topology.pp} pipeline ranks x {self.topology.dp} data-parallel replicas, "
                f"schedule={self.schedule}, stages={self.layout.num_stages}, partition {self.partition} "
                f"(balancer={self.options.balancer})")

    # ------------------------------------------------------------------ running it
    def check_loader(self, loaders) -> None:
        """Before the first training step: the loader's batch sizes suit the schedule."""
        self._batch_sizes.check_loader(loaders, self.layout.pp_size)

    def engine_for(self, inputs: torch.Tensor, targets: torch.Tensor | None, precision_plugin, train: bool,
                   predict: bool = False):
        """The engine that runs this batch (built, or cached for its shapes and placement)."""
        module = self._lightning.lightning_module
        # a partial last batch runs with fewer micro-batches (strategy/partial_batch.py)
        m, partial = self._batch_sizes.microbatches(inputs.shape[0], self.layout.pp_size)
        if train and not partial:
            self.last_microbatches = m
        placement = Placement.of(self.layout, self._layers, self.pipeline_group, self._lightning.root_device)
        loss_fn = None
        if not predict:  # each micro-batch's loss weighted by its tokens (strategy/token_weights.py)
            self._token_weights.begin(targets, m, self.data_parallel_group, self.topology.dp)
            loss_fn = self._token_weights.weighted(module.pipeline_loss)
        inputs_fn = getattr(module, "pipeline_inputs", None)
        step_loss = pipeline_loss_fn(precision_plugin, self.window.scaled(loss_fn)) if train else loss_fn
        engine = self.engines.get(placement, inputs, m, train, step_loss, targets,
                                  inputs_fn if callable(inputs_fn) else None)
        if self.options.compile:  # placed at setup or arrived by migration (after the eager shape discovery)
            compile_local_layers(self._layers, self.local_layer_indices())
        return engine

    def before_batch(self, step: int) -> None:
        """A training batch that opens an optimizer step: the rebalancer's decision for it."""
        self.adopt(self.rebalancer.before_step(step, self.snapshot()))  # a decision's collectives

    def train_batch(self, batch, batch_idx, precision_plugin) -> torch.Tensor:
        """Forward and backward of every micro-batch (the schedule), then the step's one exchange;
        returns the batch loss, the same on every rank. The gradients are held until
        :meth:`finish_gradients` (Lightning zeroes them in between)."""
        side = self._lightning
        module = side.lightning_module
        step = module.trainer.global_step
        inputs, targets = split_batch(batch)
        if not self.released:  # same batch everywhere, grad-ness unchanged (strategy/step_guard.py)
            check_before_run(self, inputs, targets, step)
        now = time.perf_counter()
        self.last_batch_size = int(inputs.shape[0])
        losses, busy, wall, loads, problem = None, 0.0, 0.0, {}, None
        self._held_grads.clear()
        if self.released:  # a released rank computes nothing; it only joins the step's collective
            self.profiler.begin_step()  # its timeline is empty, not its last active step's
        else:
            with precision_plugin.train_step_context():
                engine = self.engine_for(inputs, targets, precision_plugin, train=True)
                self.window.set_aside(module.parameters())  # the schedule computes this batch's gradients alone
                self.profiler.begin_step()
                losses = unscale_losses(precision_plugin, engine.run(inputs, targets, train=True))
                losses = self.window.batch_losses(losses)  # each batch's loss, not divided by k
            self._held_grads.hold(module.parameters())
            busy, wall, problem = sum(self.profiler.busy_seconds().values()), engine.last_step_seconds, engine.problem
            loads = collect_load_factors(self._layers, self.local_layer_indices())
        stats = exchange_step_stats(
            losses=losses, profiled=self.rebalancer.profiling, busy=busy, wall=wall, loads=loads,
            topology=self.topology, active_pp=self.layout.pp_size, num_layers=len(self._layers),
            global_rank=side.global_rank, device=side.root_device, problem=problem is not None,
        )
        raise_step_problem(problem, stats.problem)
        window = self.window.note(stats, check_loss(stats.loss, step, self.options.on_nonfinite))
        if window is not None:  # the accumulation window's last batch (every batch without accumulation)
            self.rebalancer.after_step(step, window, self.snapshot())
        log_step(module, stats, inputs, now, self._last_step_end, self.topology.dp, self.layout.pp_size)
        self._last_step_end = now
        hook = getattr(module, "on_pipeline_train_loss", None)
        if callable(hook):  # the module's training_step is not called under the pipeline
            hook(stats.loss, batch, batch_idx)
        return stats.loss

    def finish_gradients(self) -> None:
        """In Lightning's ``backward``: this batch's gradients back (added to the accumulation
        window's), tied copies summed, and at the window's last batch the data-parallel exchange."""
        params = self._lightning.lightning_module.parameters
        self._held_grads.restore()
        if not self.released:  # (this batch's gradients, before the window's sum)
            self.dp_sharding.after_batch(self.data_parallel_group)
        exchange = self.window.last and self.window.apply
        if not self.released:  # at the exchange, tied gradients cross the data-parallel group once (runtime/tied.py)
            self.tied.sync_gradients(self._layers,
                                     replicated=exchange and self.dp_sharding.tied_replicated(self.topology.dp))
        self.window.add_batch()
        if exchange:
            self.dp_sharding.exchange(params(), self.tied, self.data_parallel_group, self.topology.dp,
                                      self.expert_shards())
            self.tied.share_gradients()
        elif self.window.last:  # on_nonfinite="skip": no gradients, so the optimizer leaves every parameter as it is
            for p in params():
                p.grad = None

    def close(self) -> None:
        """Free the built stages and the profiling hooks (the layers stay)."""
        if self.engines is not None:
            self.engines.clear()
        if self.profiler is not None:
            self.profiler.stop_layer_profiling()

    def summary_at_end(self) -> None:
        """The end-of-fit line: what DynMo cost and what its applied decisions gained."""
        if self.rebalancer.policy.rebalances:
            rank_zero_info(dynmo_summary_text(self.dynmo_summary))
