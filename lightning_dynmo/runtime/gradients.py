"""Gradients of a pipeline step: held across Lightning's zero_grad, averaged over data-parallel
replicas, and clipped by the norm of the *whole* model when its layers live on several ranks.

Clipping: Lightning clips through the precision plugin and each rank only sees its own stage's
gradients. :func:`clip_by_global_norm` computes exactly what ``torch.nn.utils.clip_grad_norm_``
computes in a single process: the per-tensor norms (``_foreach_norm``, bitwise the same on any
rank) are placed at each parameter's single-process position, summed over the pipeline group
(every slot has one owner, so the sum is exact), and the norm of that vector is taken in
single-process order. Clipping therefore gives bitwise the same coefficient as single-process
training.
"""
from __future__ import annotations

import types
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .expert_parallel import ExpertShards

#: ``optimizer -> (this rank's [(single-process position, parameter)], total parameter count)``
PositionsFn = Callable[[object], tuple[list[tuple[int, nn.Parameter]], int]]


class HeldGradients:
    """Lightning zeroes gradients between ``training_step`` and ``backward``; the pipeline has
    already computed them inside the schedule, so they wait here until ``backward``."""

    def __init__(self) -> None:
        self._held: list[tuple[nn.Parameter, torch.Tensor]] = []

    def hold(self, params: Iterable[nn.Parameter]) -> None:
        self._held = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._held:
            p.grad = None

    def restore(self) -> None:
        for p, g in self._held:
            p.grad = g
        self._held = []

    def clear(self) -> None:
        self._held = []


def _mean_over(grads: list[torch.Tensor], group, divisor: int) -> None:
    """Sum ``grads`` over ``group`` (``None``: no one else) as one flat all-reduce, then divide."""
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= divisor
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def average_over_replicas(params: Iterable[nn.Parameter], group, replicas: int,
                          experts: ExpertShards | None = None) -> None:
    """Mean of each gradient over the data-parallel group; expert shards (``experts.params``) are
    summed over the replicas holding the same shard instead (see the module docstring)."""
    if replicas == 1:
        return
    params = list(params)
    shard_ids = experts.params if experts is not None else frozenset()
    trainable = [p for p in params if p.requires_grad or p.grad is not None]
    _mean_over(_present_anywhere([p for p in trainable if id(p) not in shard_ids], group), group, replicas)
    average_expert_shards(params, replicas, experts)


def average_expert_shards(params: Iterable[nn.Parameter], replicas: int, experts: ExpertShards | None) -> None:
    """The expert shards among ``params``: summed over the replicas holding the same shard, divided
    by the ``replicas`` of the data-parallel group (under ``dp_sharding="fsdp"`` this is all the
    exchange does: the units' reduce-scatters average the rest)."""
    if replicas == 1 or experts is None or not experts.params:
        return
    shards = [p for p in params if id(p) in experts.params and (p.requires_grad or p.grad is not None)]
    _mean_over(_present_anywhere(shards, experts.same_shard), experts.same_shard, replicas)


def _present_anywhere(params: list[nn.Parameter], group) -> list[torch.Tensor]:
    """The gradients to all-reduce: those of parameters that got one on *any* replica of ``group``
    (one small all-reduce of a presence mask). A replica whose batch gave a parameter no gradient
    (a path no token of its batch took: an exit, a route) contributes zeros, as that part of the
    batch would in single-process training; without this the replicas' flat buffers differ in
    size and the all-reduce aborts. A parameter with no gradient anywhere keeps ``None``."""
    if not params:
        return []
    device = next((p.grad.device for p in params if p.grad is not None), params[0].device)
    mask = torch.tensor([float(p.grad is not None) for p in params], device=device)
    if group is not None:
        dist.all_reduce(mask, group=group)
    out = []
    for p, n in zip(params, mask.tolist()):
        if n > 0:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
    return out


def _whole_expert_norms(slots: list, local: list[torch.Tensor], experts: ExpertShards | None) -> list[torch.Tensor]:
    """Norms of whole expert parameters from this rank's shards (one all-reduce over the peers
    holding the other shards, which hold the same parameters); others unchanged."""
    if experts is None:
        return local
    which = [k for k, (_, p) in enumerate(slots) if id(p) in experts.params]
    if not which:
        return local
    squares = torch.stack([local[k].float() for k in which]).square()
    dist.all_reduce(squares, group=experts.peers)
    local = list(local)
    for k, sq in zip(which, squares.sqrt()):
        local[k] = sq
    return local


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (a DTensor shard under ``dp_sharding="fsdp"``; it shares storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _whole_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm; a DTensor shard's is made whole from its shards' (one all-reduce of
    the squares over the data-parallel group: every replica of the stage holds the same tensors)."""
    local = list(torch._foreach_norm([_local(g) for g in grads], 2.0))
    which = [k for k, g in enumerate(grads) if isinstance(g, DTensor)]
    if which:
        squares = torch.stack([local[k].double() for k in which]).square()
        dist.all_reduce(squares, group=grads[which[0]].device_mesh.get_group())
        for k, sq in zip(which, squares.sqrt()):
            local[k] = sq.to(local[k].dtype)
    return local


def clip_by_global_norm(optimizer, clip_val: float, positions: PositionsFn, group,
                        experts: ExpertShards | None = None) -> None:
    """Scale this rank's gradients of ``optimizer`` so the whole model's norm is <= ``clip_val``
    (collective over the pipeline ``group``, and over the expert peers when ``experts`` is given)."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    slots, total = positions(opt)
    slots = [(i, p) for i, p in slots if p.grad is not None]
    grads = [p.grad for _, p in slots]
    device = grads[0].device if grads else torch.device("cpu")
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    norms = torch.zeros(total, dtype=torch.float32, device=device)
    present = torch.zeros(total, dtype=torch.float32, device=device)
    if grads:
        local = _whole_expert_norms(slots, _whole_norms(grads), experts)
        idx = torch.tensor([i for i, _ in slots], device=device)
        norms[idx] = torch.stack([n.to(device, torch.float32) for n in local])
        present[idx] = 1.0
    if dist.is_initialized():
        both = torch.cat([norms, present])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        norms, present = both[:total], both[total:]
    total_norm = torch.linalg.vector_norm(norms[present > 0], 2.0)
    coef = torch.clamp(float(clip_val) / (total_norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_([_local(g) for g in grads], coef.to(grads[0].device))


def install_global_norm_clipping(plugin, positions: PositionsFn, group: Callable[[], object],
                                 active: Callable[[], bool],
                                 experts: Callable[[], ExpertShards | None] = lambda: None) -> None:
    """Give ``plugin`` (any Lightning precision plugin) a ``clip_grad_by_norm`` that clips by the
    global norm over the pipeline group ``group()`` (expert shards from ``experts()`` counted
    once); a rank where ``active()`` is False (released by re-packing) holds no gradients and
    skips it. The plugin's class is left as it is: only this instance's method is replaced, so
    any precision a user picks keeps its behaviour."""

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if active():
            clip_by_global_norm(optimizer, clip_val, positions, group(), experts())

    plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)
