"""Execute a :class:`~lightning_dynmo.plan.MigrationPlan`: move whole layers between ranks (P2P).

A moved layer carries everything it owns: parameters (with ``requires_grad``), buffers (pruning
masks, sparse structure), accumulated gradients and its optimizer state. The structure travels
as a tensor-free skeleton (the module deep-copied onto the meta device), the data as one flat
byte buffer per layer, sent straight from the old owner to the new one.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..plan.migration_plan import MigrationPlan
from ..protocol import RemoteLayer
from .optimizer_layout import OptimizerLayout
from .tied import TiedParameters, retie


@dataclass
class MigrationStats:
    layers_sent: int = 0
    layers_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    moves: list[str] = field(default_factory=list)


def _meta_skeleton(layer: nn.Module) -> nn.Module:
    """Deep copy of ``layer`` whose parameters and buffers live on the meta device (no data)."""
    memo: dict[int, object] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(layer, memo)


def _as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def pack_layer(
    layer: nn.Module, prefix: str, optimizers: list[Optimizer], layout: OptimizerLayout, device: torch.device,
    keep: frozenset[str] = frozenset(),
) -> tuple[dict, torch.Tensor]:
    """Detach ``layer``'s optimizer state and serialise everything it owns. Parameters named in
    ``keep`` (tied parameters another local layer still uses) stay in the optimizer; a copy of
    their state travels."""
    entries: list[tuple] = []  # (kind, name, key, shape, dtype, on_cpu)
    chunks: list[torch.Tensor] = []
    extras: dict[str, dict] = {}

    def add(kind: str, name: str, key: str | None, t: torch.Tensor) -> None:
        entries.append((kind, name, key, tuple(t.shape), t.dtype, t.device.type == "cpu"))
        chunks.append(_as_bytes(t, device))

    for name, p in layer.named_parameters():
        add("param", name, None, p)
        if p.grad is not None:
            add("grad", name, None, p.grad)
        if name in keep:
            state = layout.copy_state(optimizers, prefix + name, p)
        else:
            state = layout.detach_param(optimizers, prefix + name, p)
        if state is not None:
            extras[name] = {}
            for k, v in state.items():
                if torch.is_tensor(v):
                    add("state", name, k, v)
                else:
                    extras[name][k] = copy.deepcopy(v)
    for name, b in layer.named_buffers():
        add("buffer", name, None, b)
    meta = {"skeleton": _meta_skeleton(layer), "entries": entries, "extras": extras}
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    return meta, flat


def unpack_layer(
    meta: dict, flat: torch.Tensor, device: torch.device
) -> tuple[nn.Module, dict[str, dict]]:
    """Rebuild a layer from :func:`pack_layer`'s output; returns it and its optimizer states."""
    layer: nn.Module = meta["skeleton"].to_empty(device=device)
    params = dict(layer.named_parameters())
    buffers = dict(layer.named_buffers())
    states: dict[str, dict] = {name: dict(v) for name, v in meta["extras"].items()}
    offset = 0
    for kind, name, key, shape, dtype, on_cpu in meta["entries"]:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        chunk = flat[offset : offset + nbytes]
        if offset % torch.empty((), dtype=dtype).element_size():
            chunk = chunk.clone()  # an odd-length int32/bool entry before it: view() needs alignment
        t = chunk.view(dtype).reshape(shape)
        offset += nbytes
        if kind == "param":
            params[name].data.copy_(t)
        elif kind == "grad":
            params[name].grad = t.clone()
        elif kind == "buffer":
            buffers[name].copy_(t)
        else:
            states.setdefault(name, {})[key] = t.to("cpu" if on_cpu else device, copy=True)
    return layer, states


def execute_migration(
    plan: MigrationPlan,
    module: nn.Module,
    layers: nn.ModuleList,
    layers_attr: str,
    optimizers: list[Optimizer],
    layout: OptimizerLayout,
    pp_rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    tied: TiedParameters | None = None,
) -> MigrationStats:
    """Carry out ``plan`` on this rank. Every pipeline rank calls it with the same plan; moves run
    in global layer order as blocking send/recv pairs, so no rank can wait on a move out of turn.

    Tied parameters: a sender that still uses one through another layer keeps it; a receiver
    that already holds one ties the arriving layer to its own copy (the copies are equal)."""
    stats = MigrationStats()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    obj_device = device if device.type == "cuda" else None
    t0 = time.perf_counter()
    for move in plan.moves:
        prefix = f"{layers_attr}.{move.layer}."
        if move.src == pp_rank:
            keep = frozenset()
            if tied:
                keep = frozenset(name for name, _ in layers[move.layer].named_parameters()
                                 if tied.held_elsewhere(layers, prefix + name, move.layer) is not None)
            meta, flat = pack_layer(layers[move.layer], prefix, optimizers, layout, device, keep)
            meta["nbytes"] = flat.numel()
            dist.send_object_list([meta], dst=ranks[move.dst], group=group, device=obj_device)
            if flat.numel():
                dist.send(flat, dst=ranks[move.dst], group=group)
            layers[move.layer] = RemoteLayer(move.layer, owner=move.dst)
            stats.layers_sent += 1
            stats.bytes_sent += flat.numel()
        elif move.dst == pp_rank:
            box = [None]
            dist.recv_object_list(box, src=ranks[move.src], group=group, device=obj_device)
            meta = box[0]
            flat = torch.empty(meta["nbytes"], dtype=torch.uint8, device=device)
            if meta["nbytes"]:
                dist.recv(flat, src=ranks[move.src], group=group)
            layer, states = unpack_layer(meta, flat, device)
            retied = set()
            if tied:
                for name, _ in list(layer.named_parameters(remove_duplicate=False)):
                    mine = tied.held_elsewhere(layers, prefix + name, move.layer)
                    if mine is not None:
                        retie(layer, name, mine)
                        retied.add(name)
            layers[move.layer] = layer
            for name, p in layer.named_parameters():
                if name not in retied:
                    layout.attach_param(optimizers, module, prefix + name, p, states.get(name))
            stats.layers_received += 1
            stats.bytes_received += flat.numel()
        else:
            continue
        stats.moves.append(f"layer {move.layer}: {move.src}->{move.dst}")
    stats.seconds = time.perf_counter() - t0
    return stats
