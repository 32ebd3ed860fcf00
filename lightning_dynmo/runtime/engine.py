"""Builds this rank's pipeline stages from a partition and runs them with a torch schedule.

An engine is cheap to rebuild: stages are given their input/output metadata from a table of
per-layer output specs, so torch's pipelining never runs its shape-inference round. The table is
discovered once per micro-batch shape (one no-grad forward of one micro-batch through the
pipeline) and stays valid when layers move, because a layer's output shape does not depend on
where it runs.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from ..plan.partition import Partition
from ..plan.schedules import ScheduleSpec
from ..protocol import PipelineProtocolError
from .checkpointing import ActivationCheckpointing, CheckpointedLayer
from .profiler import PipelineProfiler, TimedPipelineStage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageModule(nn.Sequential):
    """A stage's layers in order. Its output is never a view (nor its own input): torch's
    schedules detach stage outputs in place after their backward, which a view does not allow
    ("Can't detach views in-place" under zero-bubble schedules), so a view is cloned. Outputs
    that own their storage, the usual case, pass through without a copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if isinstance(out, torch.Tensor) and (out._is_view() or out is x):
            out = out.clone()
        return out


def loss_name(loss_fn: LossFn) -> str:
    owner = getattr(inspect.unwrap(loss_fn), "__self__", None)
    return f"{type(owner).__name__}.pipeline_loss" if owner is not None else getattr(loss_fn, "__qualname__", "pipeline_loss")


def check_loss_value(loss, loss_fn: LossFn) -> str | None:
    """Why ``loss`` cannot drive a backward (None: it can)."""
    if not isinstance(loss, torch.Tensor):
        return (f"{loss_name(loss_fn)}(output, target) must return a scalar tensor (the micro-batch's mean loss), "
                f"it returned {type(loss).__name__}")
    if loss.numel() != 1:
        return (f"{loss_name(loss_fn)}(output, target) must return a scalar (0-dim) tensor, the micro-batch's mean "
                f"loss; it returned shape {list(loss.shape)}. Reduce it, e.g. `return loss.mean()` or "
                "F.cross_entropy(..., reduction='mean')")
    if not loss.is_floating_point():
        return f"{loss_name(loss_fn)}(output, target) must return a floating-point loss, it returned {loss.dtype}"
    return None


def check_loss_grad(loss_fn: LossFn, output: torch.Tensor, needs_grad: bool, target: torch.Tensor) -> str | None:
    """:func:`check_loss_value`, plus: a loss of an output that needs a gradient must need one
    too (``out.detach()`` in the loss would train nothing, where one process raises)."""
    with torch.enable_grad():
        loss = loss_fn(output.detach().requires_grad_(needs_grad), target)
    problem = check_loss_value(loss, loss_fn)
    if problem is None and needs_grad and not loss.requires_grad:
        problem = (f"{loss_name(loss_fn)}(output, target) returned a loss that does not require grad, so no "
                   "gradient would reach any layer (single-process Lightning raises here too). Compute the loss "
                   "from `output` without `.detach()`, `.item()` or `torch.no_grad()`")
    return problem


def checked_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with a check that names the fix (the schedule calls it on the last stage)."""

    def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(output, target)
        problem = check_loss_value(loss, loss_fn)
        if problem:
            raise PipelineProtocolError(problem)
        return loss

    return fn


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and grad-ness of one activation for one micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor, requires_grad: bool | None = None) -> "TensorSpec":
        rg = t.requires_grad if requires_grad is None else requires_grad
        return cls(tuple(t.shape), t.dtype, bool(rg and t.is_floating_point()))

    def example(self) -> torch.Tensor:
        # Non-first stages must get an input example that requires grad, or torch allocates recv
        # buffers without grad and silently sends no gradient upstream.
        return torch.empty(self.shape, dtype=self.dtype, device="meta", requires_grad=self.requires_grad)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, eq=False)
class Placement:
    """Where this rank sits in the pipeline: the layer list, the partition, the schedule's
    stage-to-rank layout, this rank's position, the pipeline group and the device."""

    layers: nn.ModuleList
    partition: Partition
    spec: ScheduleSpec
    pp_rank: int
    pp_size: int
    group: dist.ProcessGroup | None
    device: torch.device


def _layer_needs_grad(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters())


def discover_layer_specs(placement: Placement, microbatch_input: torch.Tensor,
                         microbatch_target: torch.Tensor | None = None, loss_fn: LossFn | None = None) -> list[TensorSpec]:
    """One no-grad forward of one micro-batch through the pipeline; returns every layer's output spec.

    Each rank runs its own stages in pipeline order and passes the activation on with a blocking
    object send; then the per-layer specs are all-gathered so every rank knows the whole table.
    With ``loss_fn`` and ``microbatch_target`` the last stage also checks that the loss is a
    scalar; a problem travels in the same all-gather, so every rank raises the same error.
    """
    layers, partition, spec = placement.layers, placement.partition, placement.spec
    pp_rank, pp_size, group, device = placement.pp_rank, placement.pp_size, placement.group, placement.device
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    obj_device = device if device.type == "cuda" else None
    local: dict[int, TensorSpec] = {}
    problem: str | None = None
    act: torch.Tensor | None = None
    act_rg = False
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for s in range(partition.num_stages):
            if spec.rank_of_stage(s, pp_size) != pp_rank:
                continue
            if s == 0:
                act, act_rg = microbatch_input, False
            else:
                prev = spec.rank_of_stage(s - 1, pp_size)
                if prev != pp_rank:
                    box = [None]
                    dist.recv_object_list(box, src=ranks[prev], group=group, device=obj_device)
                    act, act_rg = box[0]
                    act = act.to(device)
            for i in partition.layers_of(s):
                act = layers[i](act)
                if not isinstance(act, torch.Tensor):
                    raise TypeError(
                        f"pipeline layer {i} ({type(layers[i]).__name__}) returned {type(act).__name__}; "
                        "every pipeline layer must return a single tensor"
                    )
                act_rg = act.is_floating_point() and (act_rg or _layer_needs_grad(layers[i]))
                local[i] = TensorSpec.of(act, act_rg)
            if s + 1 < partition.num_stages:
                nxt = spec.rank_of_stage(s + 1, pp_size)
                if nxt != pp_rank:
                    dist.send_object_list([(act.cpu(), act_rg)], dst=ranks[nxt], group=group, device=obj_device)
            elif loss_fn is not None and microbatch_target is not None:
                try:
                    problem = check_loss_grad(loss_fn, act, act_rg, microbatch_target)
                except Exception as err:  # noqa: BLE001 - reported on every rank below
                    problem = f"{loss_name(loss_fn)}(output, target) raised {type(err).__name__}: {err}"
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, (local, problem), group=group)
    problems = [p for _, p in gathered if p]
    if problems:
        raise PipelineProtocolError(problems[0])
    table: dict[int, TensorSpec] = {}
    for part, _ in gathered:
        table.update(part)
    missing = [i for i in range(len(layers)) if i not in table]
    if missing:
        raise RuntimeError(f"layer spec discovery missed layers {missing}")
    return [table[i] for i in range(len(layers))]


class PipelineEngine:
    """This rank's stages of one partition plus the schedule that drives them."""

    def __init__(
        self,
        placement: Placement,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        input_spec: TensorSpec,
        layer_specs: list[TensorSpec],
        profiler: PipelineProfiler,
        recompute: frozenset[int] = frozenset(),
    ) -> None:
        layers, partition, spec = placement.layers, placement.partition, placement.spec
        pp_rank, pp_size, group, device = placement.pp_rank, placement.pp_size, placement.group, placement.device
        self.partition = partition
        self.spec = spec
        self.pp_rank = pp_rank
        self.microbatches = microbatches
        self.recompute = frozenset(recompute)  # layers run under activation checkpointing
        self.local_stage_ids = spec.stages_of_rank(pp_rank, pp_size, partition.num_stages // pp_size)
        S = partition.num_stages
        self.stages: list[TimedPipelineStage] = []
        for s in self.local_stage_ids:
            rng = partition.layers_of(s)
            submod = StageModule(*[CheckpointedLayer(layers[i], i) if i in self.recompute else layers[i] for i in rng])
            in_spec = input_spec if s == 0 else layer_specs[rng.start - 1]
            out_spec = layer_specs[rng.stop - 1]
            profiler.register_stage(s, rng)
            self.stages.append(
                TimedPipelineStage(
                    submod,
                    stage_index=s,
                    num_stages=S,
                    device=device,
                    input_args=(in_spec.example(),),
                    output_args=(out_spec.example(),),
                    group=group,
                    profiler=profiler,
                )
            )
        schedule_cls = get_schedule_class(spec.torch_class)
        loss_fn = checked_loss(loss_fn)
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

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True) -> list[torch.Tensor] | None:
        """Run one step over the whole batch; returns per-micro-batch losses on the last-stage rank."""
        args = (inputs,) if self.has_first else ()
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
                self.schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        self.last_step_seconds = time.perf_counter() - t0
        return losses if self.has_last else None


class EngineCache:
    """Engines by (train/eval, micro-batch shape, dtype, count), plus the per-layer output specs
    by micro-batch shape. Engines hold references to layers, so they are dropped whenever layers
    move (:meth:`clear_engines`); the specs stay valid until a layer changes structure
    (:meth:`clear`)."""

    def __init__(self, profiler: PipelineProfiler, checkpointing: ActivationCheckpointing | None = None) -> None:
        self.profiler = profiler
        self.checkpointing = checkpointing  # which layers training engines recompute (None: none)
        self._engines: dict[tuple, PipelineEngine] = {}
        self._layer_specs: dict[tuple, list[TensorSpec]] = {}

    def get(self, placement: Placement, inputs: torch.Tensor, microbatches: int, train: bool,
            loss_fn: LossFn, targets: torch.Tensor | None = None) -> PipelineEngine:
        mb_shape = (inputs.shape[0] // microbatches, *inputs.shape[1:])
        key = (train, mb_shape, inputs.dtype, microbatches)
        engine = self._engines.get(key)
        if engine is None:
            spec_key = (mb_shape, inputs.dtype)
            if spec_key not in self._layer_specs:
                target = targets[: mb_shape[0]] if targets is not None else None
                self._layer_specs[spec_key] = discover_layer_specs(placement, inputs[: mb_shape[0]], target, loss_fn)
            recompute = frozenset()
            if train and self.checkpointing is not None and self.checkpointing.enabled:
                recompute = self.checkpointing.layers_to_recompute(
                    placement.layers, placement.partition, placement.spec, placement.pp_rank, placement.pp_size,
                    self._layer_specs[spec_key], inputs[: mb_shape[0]], microbatches)
            engine = PipelineEngine(placement, microbatches, loss_fn, TensorSpec.of(inputs[: mb_shape[0]], requires_grad=False),
                                    self._layer_specs[spec_key], self.profiler, recompute)
            self._engines[key] = engine
        return engine

    def layer_specs(self) -> list[TensorSpec] | None:
        """Per-layer output specs of the first shape seen (grad-ness is the same for every shape)."""
        return next(iter(self._layer_specs.values()), None)

    def activation_bytes(self) -> list[float] | None:
        """Per-layer output bytes per micro-batch of the first shape seen (None before any step)."""
        specs = next(iter(self._layer_specs.values()), None)
        return [float(sp.nbytes) for sp in specs] if specs else None

    def clear_engines(self) -> None:
        self._engines.clear()

    def clear(self) -> None:
        self._engines.clear()
        self._layer_specs.clear()
        if self.checkpointing is not None:
            self.checkpointing.saved_bytes.clear()  # measured per layer structure
