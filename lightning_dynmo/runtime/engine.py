"""Builds this rank's pipeline stages from a partition and runs them with a torch schedule.

An engine is cheap to rebuild: stages are given their input/output metadata from a table of
per-layer output specs (:mod:`~lightning_dynmo.runtime.tensor_specs`, discovered once per
micro-batch shape), so torch's pipelining never runs its shape-inference round.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from ..protocol import PipelineProtocolError
from ..protocol.activations import as_acts, call_layer, output_problem, unpack
from .loss_checks import LossFn, checked_loss
from .placement import Placement
from .profiler import PipelineProfiler, TimedPipelineStage
from .recompute import ActivationCheckpointing, CheckpointedLayer
from .tensor_specs import ActSpec, InputsFn, TensorSpec, act_examples, act_nbytes, act_spec, discover_layer_specs, \
    first_stage_inputs


class StageModule(nn.Sequential):
    """A stage's layers in order, called with the pipeline's convention (``protocol/activations.py``).

    Each layer's output is checked against the spec discovered for it (arity, shape, dtype: a
    cheap comparison). A mismatch is recorded in ``problems`` and replaced by zeros of the
    discovered shape, so the schedule's sends and receives still pair up on every rank; the
    engine reports it after the step and every rank raises it (never a hang).

    Its output is never a view (nor one of its own inputs): torch's schedules detach stage
    outputs in place after their backward, which a view does not allow ("Can't detach views
    in-place" under zero-bubble schedules), so such a tensor is cloned. Outputs that own their
    storage, the usual case, pass through without a copy."""

    def __init__(self, layers: list[nn.Module], indices: range, specs: list | None = None,
                 problems: list[str] | None = None) -> None:
        super().__init__(*layers)
        self.indices = list(indices)
        self.specs = specs
        self.problems = problems if problems is not None else []

    def forward(self, *xs: torch.Tensor):
        acts = tuple(xs)
        for index, layer in zip(self.indices, self):
            inner = layer.layer if isinstance(layer, CheckpointedLayer) else layer
            out = call_layer(inner, acts, fn=layer if inner is not layer else None)
            expected = self.specs[index] if self.specs is not None else None
            problem = output_problem(index, inner, out, expected)
            if problem is None:
                acts = as_acts(out)
                continue
            if expected is None:
                raise PipelineProtocolError(problem)
            self.problems.append(problem)
            acts = tuple(torch.zeros(sp.shape, dtype=sp.dtype, device=xs[0].device).requires_grad_(sp.requires_grad)
                         for sp in expected)
        acts = tuple(t.clone() if t._is_view() or any(t is x for x in xs) else t for t in acts)
        return unpack(acts)


def raise_step_problem(problem: str | None, flagged: bool, group: dist.ProcessGroup | None = None) -> None:
    """After a step whose one collective said some rank saw a protocol problem (``flagged``, the
    same on every rank): gather the messages and raise the first on every rank."""
    if not flagged:
        return
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, problem, group=group)
    raise PipelineProtocolError(next((p for p in gathered if p), "a pipeline layer broke the activation protocol"))


class PipelineEngine:
    """This rank's stages of one partition plus the schedule that drives them."""

    def __init__(
        self,
        placement: Placement,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        input_spec: ActSpec,
        layer_specs: list[ActSpec],
        profiler: PipelineProfiler,
        recompute: frozenset[int] = frozenset(),
        inputs_fn: InputsFn | None = None,
        wrap_stage: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        layers, partition, spec = placement.layers, placement.partition, placement.spec
        pp_rank, pp_size, group, device = placement.pp_rank, placement.pp_size, placement.group, placement.device
        self.partition = partition
        self.spec = spec
        self.pp_rank = pp_rank
        self.microbatches = microbatches
        self.inputs_fn = inputs_fn  # the model's pipeline_inputs hook (None: the inputs alone)
        self.problems: list[str] = []  # protocol problems the stages met in the last step
        self.recompute = frozenset(recompute)  # layers run under activation checkpointing
        self.local_stage_ids = spec.stages_of_rank(pp_rank, pp_size, partition.num_stages // pp_size)
        S = partition.num_stages
        self.stages: list[TimedPipelineStage] = []
        for s in self.local_stage_ids:
            rng = partition.layers_of(s)
            submod = StageModule([CheckpointedLayer(layers[i], i) if i in self.recompute else layers[i] for i in rng],
                                 rng, layer_specs, self.problems)
            if wrap_stage is not None:  # dp_sharding="fsdp": the stage is its layers' FSDP root (runtime/fsdp.py)
                submod = wrap_stage(submod)
            in_spec = input_spec if s == 0 else layer_specs[rng.start - 1]
            out_spec = layer_specs[rng.stop - 1]
            profiler.register_stage(s, rng)
            self.stages.append(
                TimedPipelineStage(
                    submod,
                    stage_index=s,
                    num_stages=S,
                    device=device,
                    input_args=act_examples(in_spec),
                    output_args=act_examples(out_spec),
                    group=group,
                    profiler=profiler,
                )
            )
        schedule_cls = get_schedule_class(spec.torch_class)
        loss_fn = profiler.timed_loss(checked_loss(loss_fn), S - 1) if loss_fn is not None else None  # None: predict
        # The mean over micro-batches is taken here, once per parameter, after the step: torch's
        # schedules divide by m per stage when that stage's last backward ends, which divides a
        # parameter shared by two stages of this rank (a tied embedding and LM head) twice, and
        # part of its gradient before the other stage has finished adding to it.
        if spec.multi:
            self.schedule = schedule_cls(self.stages, microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = schedule_cls(self.stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
        self.has_first = any(st.is_first for st in self.stages)
        self.has_last = any(st.is_last for st in self.stages)
        self.last_step_seconds = 0.0
        self.output: object | None = None  # the last evaluation's output (run(..., keep_output=True))

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True,
            keep_output: bool = False) -> list[torch.Tensor] | None:
        """Run one step over the whole batch; returns per-micro-batch losses on the last-stage rank.
        A protocol problem a stage met is left in :attr:`problem` for the step's collective. An
        evaluation run with ``keep_output`` also leaves the last layer's output for the whole batch
        (micro-batches merged along dim 0) in :attr:`output` on the last-stage rank."""
        args = first_stage_inputs(inputs, targets, self.inputs_fn) if self.has_first else ()
        self.problems.clear()
        target = targets if self.has_last else None
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        if train:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            if self.microbatches != 1:
                seen: set[int] = set()
                for stage in self.stages:
                    for p in stage.submod.parameters():
                        if id(p) not in seen and p.grad is not None:
                            seen.add(id(p))
                            p.grad.div_(self.microbatches)
        else:
            with torch.no_grad():
                output = self.schedule.eval(*args, target=target, losses=losses, return_outputs=keep_output)
            self.output = output if keep_output and self.has_last else None
        self.last_step_seconds = time.perf_counter() - t0
        return losses if self.has_last else None

    def predict(self, inputs: torch.Tensor) -> object | None:
        """Forward only, no loss (an engine built with ``loss_fn=None``): the last layer's output
        for the whole batch (micro-batches merged along dim 0) on the last stage's rank, else None."""
        args = first_stage_inputs(inputs, None, self.inputs_fn) if self.has_first else ()
        self.problems.clear()
        t0 = time.perf_counter()
        with torch.no_grad():
            output = self.schedule.eval(*args)
        self.last_step_seconds = time.perf_counter() - t0
        return output if self.has_last else None

    @property
    def problem(self) -> str | None:
        return self.problems[0] if self.problems else None


class EngineCache:
    """Engines by (train/eval, micro-batch shape, dtype, count), plus the per-layer output specs
    by micro-batch shape. Engines hold references to layers, so they are dropped whenever layers
    move (:meth:`clear_engines`); the specs stay valid until a layer changes structure
    (:meth:`clear`)."""

    def __init__(self, profiler: PipelineProfiler, checkpointing: ActivationCheckpointing | None = None,
                 wrap_stage: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self.profiler = profiler
        self.checkpointing = checkpointing  # which layers training engines recompute (None: none)
        self.wrap_stage = wrap_stage  # what each stage module becomes (dp_sharding="fsdp": an FSDP root)
        self._engines: dict[tuple, PipelineEngine] = {}
        self._layer_specs: dict[tuple, list[TensorSpec]] = {}

    def get(self, placement: Placement, inputs: torch.Tensor, microbatches: int, train: bool,
            loss_fn: LossFn, targets: torch.Tensor | None = None, inputs_fn: InputsFn | None = None) -> PipelineEngine:
        mb = inputs.shape[0] // microbatches
        mb_shape = (mb, *inputs.shape[1:])
        key = (train, loss_fn is None, mb_shape, inputs.dtype, microbatches)
        engine = self._engines.get(key)
        if engine is None:
            spec_key = (mb_shape, inputs.dtype)
            target = targets[:mb] if targets is not None else None
            first = first_stage_inputs(inputs[:mb], target, inputs_fn)
            if spec_key not in self._layer_specs:
                self._layer_specs[spec_key] = discover_layer_specs(placement, first, target, loss_fn)
            recompute = frozenset()
            if train and self.checkpointing is not None and self.checkpointing.enabled:
                recompute = self.checkpointing.layers_to_recompute(
                    placement.layers, placement.partition, placement.spec, placement.pp_rank, placement.pp_size,
                    self._layer_specs[spec_key], first, microbatches)
            engine = PipelineEngine(placement, microbatches, loss_fn, act_spec(first, (False,) * len(first)),
                                    self._layer_specs[spec_key], self.profiler, recompute, inputs_fn,
                                    self.wrap_stage)
            self._engines[key] = engine
        return engine

    def layer_specs(self) -> list[TensorSpec] | None:
        """Per-layer output specs of the first shape seen (grad-ness is the same for every shape)."""
        return next(iter(self._layer_specs.values()), None)

    def activation_bytes(self) -> list[float] | None:
        """Per-layer output bytes per micro-batch of the first shape seen (None before any step)."""
        specs = next(iter(self._layer_specs.values()), None)
        return [float(act_nbytes(sp)) for sp in specs] if specs else None

    def clear_engines(self) -> None:
        self._engines.clear()

    def clear(self) -> None:
        self._engines.clear()
        self._layer_specs.clear()
        if self.checkpointing is not None:
            self.checkpointing.saved_bytes.clear()  # measured per layer structure
