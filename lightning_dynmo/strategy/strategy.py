"""``DynMoStrategy``: Lightning's ParallelStrategy for pipeline (x data) parallel training.

How a training step runs (automatic optimisation, unchanged for the user):

1. ``training_step`` runs the whole pipeline schedule (forward *and* backward of every
   micro-batch) with ``torch.distributed.pipelining`` and returns the batch loss, which every
   rank learns from the step's one all-reduce. The module's own ``training_step`` is not called;
   its ``on_pipeline_train_loss(loss, batch, batch_idx)`` hook is, on every rank. A non-finite
   loss stops training with an error naming the step (``on_nonfinite``). Lightning zeroes
   gradients between ``training_step`` and ``backward``, so the pipeline's gradients are held
   aside until ``backward``.
2. ``backward`` restores them, sums the gradients of tied parameters over their owners, averages
   over data-parallel replicas and fires the usual ``on_before_backward``/``on_after_backward`` hooks.
3. Lightning clips (by the global norm across stages) and steps each rank's optimizer, which
   holds only the parameters of the layers that rank owns.

Between steps the :class:`~lightning_dynmo.strategy.rebalancer.Rebalancer` may change the
partition: layers move with their full state and the next step builds new stages from cached
shape metadata. This class holds the Lightning hooks and the rank's pipeline state only; the
rebalancer and the checkpoint functions get that state as a value (:meth:`DynMoStrategy._pipe`)
and hand back a new layout (:class:`~lightning_dynmo.strategy.state.Relayout`) that only this
class adopts.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from ..plan.layout import PipelineLayout
from ..plan.measurements import KnownWork
from ..protocol import layers_attribute_name, pipeline_layers_of, split_batch
from ..runtime.compile import compile_local_layers
from ..runtime.engine import EngineCache, raise_step_problem
from ..runtime.dp_sharding import Fsdp, Replicate
from ..runtime.expert_parallel import ExpertParallel
from ..runtime.fsdp import ShardedLayers, check_expert_shard_optimizers, check_fsdp_composition, dp_mesh
from ..runtime.fault import install as install_failure_board, step_region
from ..runtime.ledger import CollectiveLedger
from ..runtime.gradients import HeldGradients, install_global_norm_clipping
from ..runtime.groups import PipelineGroups, groups_of_layout
from ..runtime.materialize import meta_init_context
from ..runtime.optimizer_layout import OptimizerLayout
from ..runtime.placement import Placement, collect_load_factors, place_local_layers
from ..runtime.precision import check_precision, install_found_inf_agreement, pipeline_loss_fn, unscale_losses
from ..runtime.profiler import PipelineProfiler
from ..runtime.memory import layer_state_bytes
from ..runtime.recompute import ActivationCheckpointing
from ..runtime.step_stats import exchange_step_stats
from ..runtime.tied import TiedParameters, find_tied_parameters
from . import checkpoint
from .accumulation import AccumulationWindow
from .api import PipelineAPI
from .checkpoint_hooks import CheckpointHooks
from .collectives import WorldStrategy, agree_before_each_batch, explain_timeout
from .evaluation import eval_batch
from .launcher import PipelineSpawnLauncher, connect, seeded_loader_for_one_replica
from .nonfinite import NonFiniteLossError, check_loss  # noqa: F401 (NonFiniteLossError: public here too)
from .options import DpSharding, PipelineOptions, StartMethod
from .partial_batch import BatchSizes
from .predict import predict_batch
from .rebalancer import Rebalancer
from .recorder import dynmo_summary_text, log_step, notify_released
from .setup_checks import check_fit, check_module, shared_cores_message, warn_skipped_eval_steps
from .signals import act_at_batch_boundary, defer_signal_handlers
from .signature import expose_options
from .state import Relayout
from .step_guard import check_before_run, check_closure_optimizers, evaluated_once, waiting_hint
from .token_weights import TokenWeights


class DynMoStrategy(PipelineAPI, CheckpointHooks, WorldStrategy):
    """Pipeline-parallel training that keeps its stages balanced while the model changes.

    The arguments other than Lightning's own are documented at
    :class:`~lightning_dynmo.strategy.options.PipelineOptions`, which validates them before any
    process starts. A model built under ``trainer.init_module(empty_init=True)`` (the meta device)
    is materialised layer by layer: each rank allocates and initialises only the layers it owns
    (see :mod:`lightning_dynmo.runtime.materialize`).
    """

    strategy_name = "dynmo"

    @expose_options  # the options as keyword-only parameters in the visible signature (LightningCLI reads it)
    def __init__(self, accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, **options: Any) -> None:
        """Lightning's own arguments, then any :class:`PipelineOptions` field by name (its default,
        type and meaning are written there, once); unknown names fail naming the closest option."""
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options = PipelineOptions.from_kwargs(options)  # every option but Lightning's own, checked once
        self.known_work = KnownWork()  # per-layer work: the rebalancer measures it, recomputation reads it
        self.rebalancer = Rebalancer(self.options, self.known_work)
        # this rank's pipeline (setup_environment / setup); only this class assigns these fields
        self.layout: PipelineLayout | None = None  # replaced (never changed in place) when layers move
        self.groups = PipelineGroups()
        self.optimizer_layout: OptimizerLayout | None = None
        self.profiler: PipelineProfiler | None = None
        self.engines: EngineCache | None = None
        self.last_batch_size: int | None = None
        self.last_microbatches: int | None = None
        self._layers: nn.ModuleList | None = None
        self._layers_attr = ""
        self._held_grads = HeldGradients()
        self._last_step_end: float | None = None
        self._batch_sizes = BatchSizes(self.options)
        self._window = AccumulationWindow()  # accumulate_grad_batches (strategy/accumulation.py)
        self.tied = TiedParameters([])  # parameters shared by several layers (set in setup)
        self.full_state_shapes: dict[str, tuple[int, ...]] = {}  # the whole model's state-dict shapes
        self.expert_parallel: ExpertParallel | None = None  # this rank's expert shard (expert_parallel > 1)
        self.dp_sharding: Replicate = Replicate()  # how stages are held over their replicas (set at setup)
        self._agreed_in_epoch_loop = False  # the ledger's per-batch agreement runs in Lightning's loop
        self._signals = None  # the cluster signals this rank received (strategy/signals.py)

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    @override
    def precision_plugin(self):
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Whatever precision the user picks clips by the norm of the whole pipeline, and a grad
        scaler's inf checks agree across the pipeline's ranks (runtime/precision.py)."""
        self._precision_plugin = plugin
        if plugin is not None:
            group, active = (lambda: self.pipeline_group), (lambda: not self.released)
            positions = lambda opt: self.optimizer_layout.positions(self.lightning_module, self.optimizers, opt)  # noqa: E731
            install_global_norm_clipping(plugin, positions, group, active, self.expert_shards)
            install_found_inf_agreement(plugin, group, active, lambda: self.root_device,
                                        lambda: self.data_parallel_group)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        """``trainer.init_module(empty_init=True)``: build on the meta device; setup materialises
        only this rank's layers (like Lightning's ModelParallelStrategy)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with meta_init_context(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def process_dataloader(self, dataloader):
        """One replica: a loader that shuffles with the global RNG gets a seeded generator, so
        every rank of the pipeline draws the same order (their global RNGs drift apart)."""
        if self.layout is not None and self.topology.dp == 1:
            return seeded_loader_for_one_replica(dataloader)
        return dataloader

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        topo = self._world_topology()
        return {"num_replicas": topo.dp, "rank": topo.dp_rank(self.global_rank)}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # layers are placed first, then each rank loads its own part

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._world_topology()  # fail in the launching process, before any worker starts
        if self.options.start_method is StartMethod.POPEN:
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = PipelineSpawnLauncher(self, start_method=self.options.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        o = self.options
        if self.layout is None:  # a later trainer stage (test/validate after fit) keeps where the layers now live
            self.layout = PipelineLayout(self._world_topology(), o.schedule, o.virtual_stages, self.global_rank)
        connect(self.cluster_environment, self.root_device, self.local_rank, o.timeout, o.process_group_backend)
        install_failure_board(self.global_rank)  # a rank that fails names itself to its peers (runtime/fault.py)
        self.ledger = CollectiveLedger(self.global_rank, self.root_device)
        self.agree(f"setup with torch {torch.__version__}")  # a job mixing torch releases fails here, naming them
        self.groups = groups_of_layout(self.layout, self.global_rank, o.timeout)
        self.expert_parallel = ExpertParallel.build(self.layout.topology, o.expert_parallel, self.global_rank,
                                                    o.timeout)

    @override
    def teardown(self) -> None:
        """Free the built stages and profiling hooks, then Lightning's teardown. The process group
        stays up (a later ``trainer.test`` or checkpoint gather needs it); it is destroyed at exit
        by Lightning's ``_destroy_dist_connection``, before gloo's threads could abort the process."""
        if self.engines is not None:
            self.engines.clear()
        if self.profiler is not None:
            self.profiler.stop_layer_profiling()
        super().teardown()

    @override
    def on_train_end(self) -> None:
        """The end-of-fit sanity check: what DynMo cost and what its applied decisions gained."""
        super().on_train_end()
        if self.rebalancer.policy.rebalances:
            rank_zero_info(dynmo_summary_text(self.dynmo_summary))

    def _adopt(self, change: Relayout | None) -> None:
        """A migration's new layout (and, after re-packing, groups) becomes this rank's; the module
        and callbacks hear which ranks a re-pack released once the strategy shows it."""
        if change is None:
            return
        self.layout = change.layout
        if change.groups is not None:
            self.groups = change.groups
            notify_released(self.lightning_module, self.layout.pp_size, self.layout.released_ranks)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_module(module, self.layout.num_stages, self.pipeline_parallel,
                     self.options.virtual_stages, self.options.activation_checkpointing, self.options.expert_parallel)
        check_precision(self.precision_plugin)
        layers = pipeline_layers_of(module)
        self._layers, self._layers_attr = layers, layers_attribute_name(module, layers)
        self.tied = TiedParameters(find_tied_parameters(layers, self._layers_attr))
        fsdp = self.options.dp_sharding is DpSharding.FSDP and self.topology.dp > 1  # (one replica: nothing to shard)
        if fsdp:  # what FSDP units cannot hold yet, refused on every rank before anything moves
            check_fsdp_composition(precision=str(self.precision_plugin.precision))
        self.model = self.precision_plugin.convert_module(self.model)
        self.full_state_shapes = checkpoint.whole_model_state_shapes(module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        warn_skipped_eval_steps(module, {TrainerFn.FITTING: ("val",), TrainerFn.VALIDATING: ("val",),
                                         TrainerFn.TESTING: ("test",)}.get(trainer.state.fn, ()))
        if fitting:
            check_fit(module, layers, self.global_rank, trainer.callbacks)
            # Built once on the full model: every parameter's group and hyper-parameters are known
            # globally, so layers can later move between ranks and checkpoints stay portable.
            self.setup_optimizers(trainer)
            self.optimizer_layout = OptimizerLayout.record(module, self.optimizers, self.tied.aliases)
            check_precision(self.precision_plugin, self.optimizers)
            check_closure_optimizers(self.optimizers, self.global_rank)
            if fsdp and self.expert_parallel is not None:
                check_expert_shard_optimizers(self.optimizers, self.root_device)
        if fitting and self.options.rank_speeds:  # measured only where ranks have cores of their own
            why = shared_cores_message(self.root_device, self.num_processes)
            if self.agree("setup: can every rank measure its speed", float(why is not None)):
                rank_zero_warn(why or "rank_speeds=True is turned off: ranks on another node share CPU cores")
                self.options = dataclasses.replace(self.options, rank_speeds=False)
                self.rebalancer.options = self.options
        if self.layout.partition is None:
            self.layout = self.layout.with_partition(self.rebalancer.initial_partition(
                layers, self.layout, self.root_device, self.global_rank, self.last_microbatches,
                self.optimizers if fitting else (), self.topology.dp if fsdp else 1))
        optimizers = self.optimizers if fitting else ()
        if fsdp:  # each local layer an FSDP unit over this stage's replicas (runtime/fsdp.py)
            self.dp_sharding = Fsdp(ShardedLayers(dp_mesh(self.data_parallel_group, self.root_device), layers,
                                                  self._layers_attr, module, optimizers, self.optimizer_layout,
                                                  expert_parallel=self.expert_parallel, tied=self.tied))
        # built on the meta device: each layer is sharded as soon as it is allocated (never the whole stage)
        place_local_layers(module, layers, self.layout, self.global_rank, self.tied, self.options.timeout, optimizers,
                           self.optimizer_layout, self.expert_parallel,
                           after_materialize=lambda i: self.dp_sharding.shard([i]))
        if self.topology.dp == 1:
            # One replica: every rank already loads the same batches; Lightning's injected
            # DistributedSampler would reshuffle a shuffle=False loader (it forces shuffle=True).
            trainer._accelerator_connector.use_distributed_sampler = False
        self.model_to_device()
        self.tied.align(layers, optimizers)  # tied copies: one object per rank, equal values
        self.dp_sharding.shard(self.local_layer_indices())  # (fsdp: layers built whole are sharded on their device)
        self.profiler = PipelineProfiler(self.root_device)
        self._token_weights = TokenWeights.of(module)
        self.engines = EngineCache(self.profiler, ActivationCheckpointing(
            self.options.activation_checkpointing, self.options.memory_capacity,
            lambda i: layer_state_bytes(self._layers[i], self.optimizers),
            self.known_work.forward),
            wrap_stage=self.dp_sharding.wrap_stage)
        self.setup_precision_plugin()
        self._signals = defer_signal_handlers(trainer)  # acted on at a training batch boundary (strategy/signals.py)
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._agreed_in_epoch_loop = agree_before_each_batch(self, trainer, self._signals)
        rank_zero_info(f"dynmo: {self.topology.pp} pipeline ranks x {self.topology.dp} data-parallel replicas, "
                       f"schedule={self.schedule}, stages={self.layout.num_stages}, partition {self.partition} "
                       f"(balancer={self.options.balancer})")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ pipeline execution
    def _engine_for(self, inputs: torch.Tensor, targets: torch.Tensor | None, train: bool, predict: bool = False):
        # a partial last batch runs with fewer micro-batches (strategy/partial_batch.py)
        m, partial = self._batch_sizes.microbatches(inputs.shape[0], self.layout.pp_size)
        if train and not partial:
            self.last_microbatches = m
        placement = Placement.of(self.layout, self._layers, self.pipeline_group, self.root_device)
        loss_fn = None
        if not predict:  # each micro-batch's loss weighted by its tokens (strategy/token_weights.py)
            self._token_weights.begin(targets, m, self.data_parallel_group, self.topology.dp)
            loss_fn = self._token_weights.weighted(self.lightning_module.pipeline_loss)
        inputs_fn = getattr(self.lightning_module, "pipeline_inputs", None)
        step_loss = pipeline_loss_fn(self.precision_plugin, self._window.scaled(loss_fn)) if train else loss_fn
        engine = self.engines.get(placement, inputs, m, train, step_loss, targets,
                                  inputs_fn if callable(inputs_fn) else None)
        if self.options.compile:  # placed at setup or arrived by migration (after the eager shape discovery)
            compile_local_layers(self._layers, self.local_layer_indices())
        return engine

    @override
    def on_train_start(self) -> None:
        self._batch_sizes.check_loader(self.lightning_module.trainer.train_dataloader, self.layout.pp_size)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        trainer = self.lightning_module.trainer
        where = f"step {trainer.global_step} (batch {batch_idx})"
        with step_region(where), explain_timeout(waiting_hint(self.global_rank, trainer.global_step), where):
            if not self._agreed_in_epoch_loop:
                act_at_batch_boundary(self._signals, trainer, self.agree)
            if not self._window.begin_batch(batch_idx, trainer.accumulate_grad_batches):
                return  # inside an accumulation window: decisions wait for the next optimizer step
            self._adopt(self.rebalancer.before_step(trainer.global_step, self._pipe()))  # a decision's collectives

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        with step_region(f"training step {self.lightning_module.trainer.global_step}"):
            self.agree("training step")  # the batch-start hooks ran: a collective one rank added there shows here
            return self._training_step(*args, **kwargs)

    def _training_step(self, *args: Any, **kwargs: Any):
        module = self.lightning_module
        inputs, targets = split_batch(args[0] if args else kwargs["batch"])
        if not self.released:  # same batch everywhere, grad-ness unchanged (strategy/step_guard.py)
            check_before_run(self, inputs, targets, module.trainer.global_step)
        now = time.perf_counter()
        self.last_batch_size = int(inputs.shape[0])
        losses, busy, wall, loads, problem = None, 0.0, 0.0, {}, None
        self._held_grads.clear()
        if self.released:
            self.profiler.begin_step()  # its timeline is empty, not its last active step's
        else:  # a released rank computes nothing; it only joins the step's collective
            with self.precision_plugin.train_step_context():
                engine = self._engine_for(inputs, targets, train=True)
                self._window.set_aside(module.parameters())  # the schedule computes this batch's gradients alone
                self.profiler.begin_step()
                losses = unscale_losses(self.precision_plugin, engine.run(inputs, targets, train=True))
                losses = self._window.batch_losses(losses)  # each batch's loss, not divided by k
            self._held_grads.hold(module.parameters())
            busy, wall, problem = sum(self.profiler.busy_seconds().values()), engine.last_step_seconds, engine.problem
            loads = collect_load_factors(self._layers, self.local_layer_indices())
        stats = exchange_step_stats(
            losses=losses, profiled=self.rebalancer.profiling, busy=busy, wall=wall, loads=loads,
            topology=self.topology, active_pp=self.layout.pp_size, num_layers=len(self._layers),
            global_rank=self.global_rank, device=self.root_device, problem=problem is not None,
        )
        raise_step_problem(problem, stats.problem)
        window = self._window.note(stats, check_loss(stats.loss, module.trainer.global_step, self.options.on_nonfinite))
        if window is not None:  # the accumulation window's last batch (every batch without accumulation)
            self.rebalancer.after_step(module.trainer.global_step, window, self._pipe())
        log_step(self.lightning_module, stats, inputs, now, self._last_step_end, self.topology.dp, self.layout.pp_size)
        self._last_step_end = now
        hook = getattr(module, "on_pipeline_train_loss", None)
        if callable(hook):  # the module's training_step is not called under the pipeline
            batch = args[0] if args else kwargs.get("batch")
            hook(stats.loss, batch, args[1] if len(args) > 1 else kwargs.get("batch_idx"))
        return stats.loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Gradients were computed by the pipeline schedule; restore them (added to the
        accumulation window's), average over replicas once per optimizer step and run the usual
        backward hooks."""
        with step_region(f"backward of step {self.lightning_module.trainer.global_step}"):
            return self._backward(closure_loss)

    def _backward(self, closure_loss: torch.Tensor) -> torch.Tensor:
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._held_grads.restore()
        if not self.released:  # (this batch's gradients, before the window's sum)
            self.dp_sharding.after_batch(self.data_parallel_group)
        exchange = self._window.last and self._window.apply
        if not self.released:  # at the exchange, tied gradients cross the data-parallel group once (runtime/tied.py)
            self.tied.sync_gradients(self._layers,
                                     replicated=exchange and self.dp_sharding.tied_replicated(self.topology.dp))
        self._window.add_batch()
        if exchange:
            self.dp_sharding.exchange(module.parameters(), self.tied, self.data_parallel_group, self.topology.dp,
                                      self.expert_shards())
            self.tied.share_gradients()
        elif self._window.last:  # on_nonfinite="skip": no gradients, so the optimizer leaves every parameter as it is
            for p in module.parameters():
                p.grad = None
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        return self._eval_step("val", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any):
        return self._eval_step("test", *args, **kwargs)

    def _eval_step(self, stage: str, *args: Any, **kwargs: Any):
        where = f"{'validation' if stage == 'val' else 'test'} batch {_batch_idx(args, kwargs)}"
        with step_region(where):  # a rank that fails or stalls here is named to its peers, as in training
            return eval_batch(self, stage, args[0] if args else kwargs["batch"],  # strategy/evaluation.py
                              _batch_idx(args, kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any):
        """Forward through the pipeline; the last layer's output, or the module's optional
        ``pipeline_predict`` of it, on every rank of the pipeline (strategy/predict.py)."""
        with step_region(f"predict batch {_batch_idx(args, kwargs)}"):
            return predict_batch(self, *args, *kwargs.values())

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        step = self.lightning_module.trainer.global_step
        with step_region(f"optimizer step {step}"), self._window.closing():  # the closure runs the window's last batch
            return super().optimizer_step(optimizer, evaluated_once(closure, optimizer, self.global_rank, step), model,
                                          **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "dynmo", cls, description="lightning_dynmo: pipeline parallel with live rebalancing", override=True
        )
        strategy_registry.register(
            "dynmo_spawn", cls, description="lightning_dynmo with spawned processes", start_method="spawn",
            override=True
        )


def _batch_idx(args: tuple, kwargs: dict) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("batch_idx", "?")


DynMoStrategy.register_strategies(StrategyRegistry)
