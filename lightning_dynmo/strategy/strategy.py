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
shape metadata. This class holds Lightning's hooks; this rank's pipeline, its state and the
rebalancing API are ``strategy.pipeline`` (:class:`~lightning_dynmo.strategy.pipeline.Pipeline`),
and the checkpoint format is ``strategy.checkpointer``, chosen once.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ..runtime.fault import install as install_failure_board, step_region
from ..runtime.gradients import install_global_norm_clipping
from ..runtime.ledger import CollectiveLedger
from ..runtime.materialize import meta_init_context
from ..runtime.precision import check_precision, install_found_inf_agreement
from . import checkpoint, checkpointer
from .collectives import BatchBoundary, WorldStrategy, explain_timeout, set_world_ranks
from .evaluation import eval_batch
from .launcher import PipelineSpawnLauncher, connect, seeded_loader_for_one_replica
from .nonfinite import NonFiniteLossError  # noqa: F401 (public here too)
from .options import PipelineOptions, StartMethod
from .pipeline import Pipeline
from .predict import predict_batch
from .setup_checks import check_fit, warn_skipped_eval_steps
from .signature import expose_options
from .step_guard import evaluated_once, waiting_hint


class DynMoStrategy(WorldStrategy):
    """Pipeline-parallel training that keeps its stages balanced while the model changes.

    The arguments other than Lightning's own are documented at
    :class:`~lightning_dynmo.strategy.options.PipelineOptions`, which validates them before any
    process starts. A model built under ``trainer.init_module(empty_init=True)`` (the meta device)
    is materialised layer by layer: each rank allocates and initialises only the layers it owns
    (see :mod:`lightning_dynmo.runtime.materialize`). What users and callbacks ask of the pipeline
    (its partition, the decisions so far, ``request_rebalance``, ``rebalance_to``, ...) is on
    ``strategy.pipeline``.
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
        # every option but Lightning's own, checked once
        self.pipeline = Pipeline(PipelineOptions.from_kwargs(options), self)
        self.checkpointer = checkpointer.checkpointer_for(self.options.checkpoint_format)
        self.batch_boundary = BatchBoundary()

    @property
    def options(self) -> PipelineOptions:
        return self.pipeline.options

    # ------------------------------------------------------------------ Lightning plumbing
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
        if self.pipeline.layout is not None and self.pipeline.topology.dp == 1:
            return seeded_loader_for_one_replica(dataloader)
        return dataloader

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        topo = self.pipeline.world_topology()
        return {"num_replicas": topo.dp, "rank": topo.dp_rank(self.global_rank)}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # layers are placed first, then each rank loads its own part

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.pipeline.world_topology()  # fail in the launching process, before any worker starts
        if self.options.start_method is StartMethod.POPEN:
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = PipelineSpawnLauncher(self, start_method=self.options.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        set_world_ranks(self)
        o = self.options
        connect(self.cluster_environment, self.root_device, self.local_rank, o.timeout, o.process_group_backend)
        install_failure_board(self.global_rank)  # a rank that fails names itself to its peers (runtime/fault.py)
        self.ledger = CollectiveLedger(self.global_rank, self.root_device)
        self.agree(f"setup with torch {torch.__version__}")  # a job mixing torch releases fails here, naming them
        self.pipeline.connect(self.global_rank, o.timeout)

    @override
    def teardown(self) -> None:
        """Free the built stages and profiling hooks, then Lightning's teardown. The process group
        stays up (a later ``trainer.test`` or checkpoint gather needs it); it is destroyed at exit
        by Lightning's ``_destroy_dist_connection``, before gloo's threads could abort the process."""
        self.pipeline.close()
        super().teardown()

    @override
    def on_train_end(self) -> None:
        """The end-of-fit sanity check: what DynMo cost and what its applied decisions gained."""
        super().on_train_end()
        self.pipeline.summary_at_end()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module, plugin, pipeline = self.lightning_module, self.precision_plugin, self.pipeline
        check_precision(plugin)
        pipeline.take_module(module, plugin)
        self.model = plugin.convert_module(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        warn_skipped_eval_steps(module, {TrainerFn.FITTING: ("val",), TrainerFn.VALIDATING: ("val",),
                                         TrainerFn.TESTING: ("test",)}.get(trainer.state.fn, ()))
        if fitting:
            check_fit(module, pipeline.layers, self.global_rank, trainer.callbacks)
            self.setup_optimizers(trainer)  # on the full model, before any layer leaves this rank
            check_precision(plugin, self.optimizers)
        pipeline.place(trainer, fitting)
        # Whatever precision the user picks clips by the norm of the whole pipeline, and a grad
        # scaler's inf checks agree across the pipeline's ranks (runtime/precision.py).
        group, active = (lambda: pipeline.pipeline_group), (lambda: not pipeline.released)
        positions = lambda opt: pipeline.optimizer_layout.positions(module, self.optimizers, opt)  # noqa: E731
        install_global_norm_clipping(plugin, positions, group, active, pipeline.expert_shards)
        install_found_inf_agreement(plugin, group, active, lambda: self.root_device,
                                    lambda: pipeline.data_parallel_group)
        self.setup_precision_plugin()
        self.batch_boundary.install(self, trainer, fitting)  # signals acted on at a batch boundary
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        rank_zero_info(pipeline.describe())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ pipeline execution
    @override
    def on_train_start(self) -> None:
        self.pipeline.check_loader(self.lightning_module.trainer.train_dataloader)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        trainer = self.lightning_module.trainer
        where = f"step {trainer.global_step} (batch {batch_idx})"
        with step_region(where), explain_timeout(waiting_hint(self.global_rank, trainer.global_step), where):
            self.batch_boundary.at_batch_start(trainer, self.agree)
            if self.pipeline.window.begin_batch(batch_idx, trainer.accumulate_grad_batches):
                self.pipeline.before_batch(trainer.global_step)  # (inside a window, decisions wait for its end)

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        with step_region(f"training step {self.lightning_module.trainer.global_step}"):
            self.agree("training step")  # the batch-start hooks ran: a collective one rank added there shows here
            return self.pipeline.train_batch(args[0] if args else kwargs["batch"], _batch_idx(args, kwargs, None),
                                             self.precision_plugin)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Gradients were computed by the pipeline schedule; restore them (added to the
        accumulation window's), average over replicas once per optimizer step and run the usual
        backward hooks."""
        module = self.lightning_module
        with step_region(f"backward of step {module.trainer.global_step}"):
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self.pipeline.finish_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        with step_region(f"validation batch {_batch_idx(args, kwargs)}"):  # a failing or stalled rank is named
            return eval_batch(self.pipeline, self.precision_plugin, self.batch_boundary.signals, "val",
                              args[0] if args else kwargs["batch"], _batch_idx(args, kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any):
        with step_region(f"test batch {_batch_idx(args, kwargs)}"):
            return eval_batch(self.pipeline, self.precision_plugin, self.batch_boundary.signals, "test",
                              args[0] if args else kwargs["batch"], _batch_idx(args, kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any):
        """Forward through the pipeline; the last layer's output, or the module's optional
        ``pipeline_predict`` of it, on every rank of the pipeline (strategy/predict.py)."""
        with step_region(f"predict batch {_batch_idx(args, kwargs)}"):
            return predict_batch(self.pipeline, self.precision_plugin, *args, *kwargs.values())

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        step = self.lightning_module.trainer.global_step
        with step_region(f"optimizer step {step}"), self.pipeline.window.closing():  # the closure runs the last batch
            return super().optimizer_step(optimizer, evaluated_once(closure, optimizer, self.global_rank, step), model,
                                          **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Read safely (``weights_only=True`` unless the caller passes ``False``; NaN/Inf refused);
        a DCP directory is read by every rank for its own layers (strategy/checkpointer.py)."""
        return checkpointer.read(self.pipeline, self.checkpoint_io, checkpoint_path, weights_only)

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """``checkpoint_format="dcp"``: every rank writes its part of ``filepath`` (a directory);
        ``"single"``: rank 0 writes the gathered file."""
        self.checkpointer.save(self, checkpoint_dict, filepath, storage_options)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict (global layer indices) on rank 0, empty elsewhere; under
        ``checkpoint_format="dcp"`` this rank's layers, on every rank."""
        self.agree("save_checkpoint (model state)")
        return self.checkpointer.model_state(self.pipeline.snapshot())

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer state in single-process format (any partition can load it), on rank 0; under
        ``checkpoint_format="dcp"`` this rank's parameters' state keyed by name, on every rank."""
        self.agree("save_checkpoint (optimizer state)")
        return self.checkpointer.optimizer_state(self.pipeline.snapshot(), optimizer)

    @override
    def load_model_state_dict(self, checkpoint_dict, strict: bool = True) -> None:
        checkpoint.load_local_model_state(self.pipeline.snapshot(), checkpoint_dict, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint_dict) -> None:
        checkpoint.load_local_optimizer_state(self.pipeline.snapshot(), checkpoint_dict)

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


def _batch_idx(args: tuple, kwargs: dict, missing: Any = "?") -> Any:
    return args[1] if len(args) > 1 else kwargs.get("batch_idx", missing)


DynMoStrategy.register_strategies(StrategyRegistry)
