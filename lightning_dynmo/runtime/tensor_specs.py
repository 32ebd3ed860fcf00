"""What each pipeline layer hands the next for one micro-batch (shape, dtype, grad-ness per
tensor), discovered once per micro-batch shape by one no-grad forward through the pipeline. The
engine gives torch's stages these specs, so its pipelining never runs its own shape inference,
and the table stays valid when layers move: a layer's output shape does not depend on where it
runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..protocol import PipelineProtocolError
from ..protocol.activations import as_acts, buffers_kept, call_layer, consumed as _consumed, describe, output_problem
from .loss_checks import LossFn, check_loss_grad, loss_name
from .placement import Placement

InputsFn = Callable[[torch.Tensor, torch.Tensor], object]


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


ActSpec = tuple  # tuple[TensorSpec, ...]: one activation (one entry per tensor)


def act_spec(acts: tuple[torch.Tensor, ...], requires_grad: tuple[bool, ...] | None = None) -> ActSpec:
    rgs = requires_grad if requires_grad is not None else (None,) * len(acts)
    return tuple(TensorSpec.of(t, rg) for t, rg in zip(acts, rgs))


def act_examples(spec: ActSpec) -> tuple[torch.Tensor, ...]:
    return tuple(sp.example() for sp in spec)


def act_nbytes(spec: ActSpec) -> int:
    return sum(sp.nbytes for sp in spec)


def first_stage_inputs(inputs: torch.Tensor, targets: torch.Tensor | None, inputs_fn: InputsFn | None) -> tuple:
    """What enters the first layer: ``inputs``, or what the model's ``pipeline_inputs(inputs,
    targets)`` hook makes of the batch (e.g. the inputs and the targets a late layer needs)."""
    if inputs_fn is None:
        return (inputs,)
    out = inputs_fn(inputs, targets)
    acts = as_acts(out)
    if acts is None:
        raise PipelineProtocolError(f"pipeline_inputs(inputs, targets) returned {describe(out)}; it must return a "
                                    "tensor or a tuple of tensors (what enters the first pipeline layer)")
    return acts


def _layer_needs_grad(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters())


def output_requires_grad(layer: nn.Module, in_rg: tuple, out_floating: tuple) -> tuple:
    """Which of ``layer``'s outputs need a gradient, from which of its inputs do (``in_rg``) and
    which outputs are floating point: the tensors it produces need one if an input it takes or its
    own parameters do; the tensors it passes through keep theirs."""
    used = _consumed(layer, len(in_rg))  # the tensors after the layer's own outputs passed through
    passed = tuple(in_rg[used:])
    grad_in = any(in_rg[:used]) or _layer_needs_grad(layer)
    return tuple(bool(f and grad_in) for f in out_floating[: len(out_floating) - len(passed)]) + passed


def _forward_spec(layers: nn.ModuleList, indices: range, acts: tuple, rg: tuple, local: dict) -> tuple:
    """Run ``indices`` on ``acts``; record each layer's output spec in ``local``. Returns
    ``(acts, requires_grad, problem)`` (``acts`` None after a problem)."""
    for i in indices:
        n_in = len(acts)
        try:
            out = call_layer(layers[i], acts)
        except Exception as err:  # noqa: BLE001 - reported on every rank
            return None, (), f"pipeline layer {i} ({type(layers[i]).__name__}) raised {type(err).__name__}: {err}"
        problem = output_problem(i, layers[i], out)
        if problem:
            return None, (), problem
        acts = as_acts(out)
        rg = output_requires_grad(layers[i], rg[:n_in], tuple(t.is_floating_point() for t in acts))
        local[i] = act_spec(acts, rg)
    return acts, rg, None


def discover_layer_specs(placement: Placement, microbatch_input, microbatch_target: torch.Tensor | None = None,
                         loss_fn: LossFn | None = None) -> list[ActSpec]:
    """One no-grad forward of one micro-batch through the pipeline; returns every layer's output spec.
    The RNG and every buffer of the layers it runs are as before it afterwards.

    Each rank runs its own stages in pipeline order and passes the activation on with a blocking
    object send; then the per-layer specs are all-gathered so every rank knows the whole table.
    With ``loss_fn`` and ``microbatch_target`` the last stage also checks that the loss is a
    scalar. A problem (a layer that raises or breaks the activation protocol, a bad loss) stops
    the forward where it happens, travels down the pipeline in place of the activation and in
    the all-gather, so every rank raises the same PipelineProtocolError.
    """
    layers, partition, spec = placement.layers, placement.partition, placement.spec
    pp_rank, pp_size, group, device = placement.pp_rank, placement.pp_size, placement.group, placement.device
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    obj_device = device if device.type == "cuda" else None
    local: dict[int, ActSpec] = {}
    problem: str | None = None
    acts: tuple | None = None
    rg: tuple = ()
    local_layers = [layers[i] for s in range(partition.num_stages) if spec.rank_of_stage(s, pp_size) == pp_rank
                    for i in partition.layers_of(s)]
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            buffers_kept(local_layers):  # no mark of this extra forward on BatchNorm-like running buffers
        for s in range(partition.num_stages):
            if spec.rank_of_stage(s, pp_size) != pp_rank:
                continue
            if s == 0:
                acts, rg = as_acts(microbatch_input), (False,) * len(as_acts(microbatch_input))
            else:
                prev = spec.rank_of_stage(s - 1, pp_size)
                if prev != pp_rank:
                    box = [None]
                    dist.recv_object_list(box, src=ranks[prev], group=group, device=obj_device)
                    acts, rg, upstream = box[0]
                    problem = problem or upstream
                    acts = tuple(t.to(device) for t in acts) if acts is not None else None
            if acts is not None:
                acts, rg, problem = _forward_spec(layers, partition.layers_of(s), acts, rg, local)
            if s + 1 < partition.num_stages:
                nxt = spec.rank_of_stage(s + 1, pp_size)
                if nxt != pp_rank:
                    sent = tuple(t.cpu() for t in acts) if acts is not None else None
                    dist.send_object_list([(sent, rg, problem)], dst=ranks[nxt], group=group, device=obj_device)
            elif acts is not None and loss_fn is not None and microbatch_target is not None:
                try:
                    problem = check_loss_grad(loss_fn, acts, rg, microbatch_target)
                except Exception as err:  # noqa: BLE001 - reported on every rank below
                    problem = f"{loss_name(loss_fn)}(output, target) raised {type(err).__name__}: {err}"
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, (local, problem), group=group)
    problems = [p for _, p in gathered if p]
    if problems:
        raise PipelineProtocolError(problems[0])
    table: dict[int, ActSpec] = {}
    for part, _ in gathered:
        table.update(part)
    missing = [i for i in range(len(layers)) if i not in table]
    if missing:
        raise RuntimeError(f"layer spec discovery missed layers {missing}")
    return [table[i] for i in range(len(layers))]
