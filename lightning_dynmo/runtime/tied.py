"""Parameters shared by several pipeline layers (GPT-2 ties its token embedding and LM head).

Megatron's way: every rank that holds a layer using a tied parameter keeps its own copy, and the
copies stay identical because, before each optimizer step, their owners sum the parameter's
gradient over a small process group of exactly those ranks; every owner then applies the same
update to the same values. Everywhere else the copies are one parameter, named by its first use
(the name ``module.named_parameters()`` gives it in a single process):

* the optimizer layout maps every alias to that name (one slot in a single-process optimizer);
* a migrated layer carries the parameter; a receiver that already holds it through another
  layer re-ties the arriving layer to its own copy, and a sender that still uses it keeps it (and
  its optimizer state);
* checkpoints hold every alias key, as a single-process ``state_dict`` does, and one optimizer
  state; gradient clipping counts the parameter once (per-slot norms are combined with MAX).

Groups are created collectively (every rank calls ``update`` with the same layout) and cached by
their ranks, so a migration that brings the users together or apart costs no new group twice.

With data-parallel replicas the gradient crosses the data-parallel group once, not once per
owner: the owners reduce it onto the first owner (``sync_gradients(replicated=True)``), only
that owner puts it into the replicas' all-reduce (:meth:`TiedParameters.averaged_once` drops it
from the others' exchange), and it sends the averaged gradient back to the other owners
(:meth:`TiedParameters.share_gradients`). The pipeline group carries what its all-reduce carried
(a reduce and a broadcast); the data-parallel all-reduce carries each tied gradient once.
Under ``dp_sharding="fsdp"`` each stage's reduce-scatter averages first, and the owners sum their
shards (the same rows on each: :mod:`.fsdp_tied`).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..plan.layout import PipelineLayout
from ..protocol import PipelineProtocolError, RemoteLayer


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (a DTensor shard under ``dp_sharding="fsdp"``; it shares storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class TiedParameter:
    attr: str  # the layer list's attribute name on the module (prefix of the keys)
    members: tuple[tuple[int, str], ...]  # (layer index, name inside the layer), in module order

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(f"{self.attr}.{i}.{name}" for i, name in self.members)

    @property
    def canonical(self) -> str:
        return self.fqns[0]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({i for i, _ in self.members}))


def find_tied_parameters(layers: nn.ModuleList, attr: str) -> list[TiedParameter]:
    """Parameters used by more than one pipeline layer. A buffer shared by layers is refused:
    buffers are not synchronised between ranks."""
    params: dict[int, list[tuple[int, str]]] = {}
    buffers: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            params.setdefault(id(p), []).append((i, name))
        for name, b in layer.named_buffers(remove_duplicate=False):
            buffers.setdefault(id(b), []).append((i, name))
    for uses in buffers.values():
        if len({i for i, _ in uses}) > 1:
            names = [f"{attr}.{i}.{n}" for i, n in uses]
            raise PipelineProtocolError(
                f"buffer {names[0]} is shared by pipeline layers {sorted({i for i, _ in uses})} ({', '.join(names)}); "
                "layers on different ranks cannot share a buffer: give each layer its own copy, or put its users "
                "in one pipeline layer"
            )
    return [TiedParameter(attr, tuple(uses)) for uses in params.values() if len({i for i, _ in uses}) > 1]


def retie(layer: nn.Module, name: str, param: nn.Parameter) -> None:
    """Make ``layer``'s parameter ``name`` the object ``param``."""
    path, _, leaf = name.rpartition(".")
    owner = layer.get_submodule(path) if path else layer
    setattr(owner, leaf, param)


class TiedParameters:
    """The tied parameters of one module and the process groups that keep their copies equal."""

    def __init__(self, tied: list[TiedParameter]) -> None:
        self.tied = tied
        self.aliases: dict[str, str] = {fqn: t.canonical for t in tied for fqn in t.fqns}
        self._by_fqn: dict[str, TiedParameter] = {fqn: t for t in tied for fqn in t.fqns}
        self._groups: dict[tuple[int, ...], object] = {}
        self._sync: list[tuple[TiedParameter, object, int]] = []  # this rank's tied params: group, first owner
        self._pending: list[tuple[nn.Parameter, object, int]] = []  # reduced onto the first owner, not shared yet

    def __bool__(self) -> bool:
        return bool(self.tied)

    def of(self, fqn: str) -> TiedParameter | None:
        return self._by_fqn.get(fqn)

    def held_elsewhere(self, layers: nn.ModuleList, fqn: str, layer_index: int) -> nn.Parameter | None:
        """This rank's copy of the tied parameter ``fqn`` through a layer other than
        ``layer_index`` (None: no other local layer uses it)."""
        t = self._by_fqn.get(fqn)
        if t is None:
            return None
        for i, name in t.members:
            if i != layer_index and not isinstance(layers[i], RemoteLayer):
                return layers[i].get_parameter(name)
        return None

    def local_param(self, layers: nn.ModuleList, t: TiedParameter) -> nn.Parameter | None:
        for i, name in t.members:
            if not isinstance(layers[i], RemoteLayer):
                return layers[i].get_parameter(name)
        return None

    # ------------------------------------------------------------------ groups
    def update(self, layout: PipelineLayout, timeout: timedelta) -> None:
        """Recompute which ranks hold each tied parameter (after placement or a migration) and
        create the groups not made yet. Collective over the world: every rank calls it with the
        same layout, so groups are created in the same order everywhere."""
        self._sync = []
        if not self.tied:
            return
        topo = layout.topology
        owners = layout.owners()
        me = layout.global_rank
        for t in self.tied:
            pp_ranks = sorted({owners[i] for i in t.layers})
            if len(pp_ranks) < 2:
                continue
            for d in range(topo.dp):
                ranks = tuple(topo.pipeline_ranks(d)[r] for r in pp_ranks)
                if ranks not in self._groups:
                    self._groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
                if me in ranks:
                    first = topo.pipeline_ranks(d)[owners[t.layers[0]]]  # holds the first user
                    self._sync.append((t, self._groups[ranks], first))

    def sync_gradients(self, layers: nn.ModuleList, replicated: bool = False) -> None:
        """Sum each tied parameter's gradient over the ranks holding a copy (before the optimizer
        step). The owners first agree whether it trains at all (a copy frozen on one rank, e.g.
        by freezing the layer that uses it there, freezes it everywhere, as the one shared
        parameter of a single process would be); an owner without a gradient contributes zeros.
        ``replicated``: data-parallel replicas follow; the sum lands on the first owner only
        (see the module docstring) and :meth:`share_gradients` completes it after their exchange."""
        self._pending = []
        self.merge_local_gradients(layers)
        me = dist.get_rank() if self._sync else -1
        for t, group, first in self._sync:
            p = self.local_param(layers, t)
            if p is None:
                continue
            trains = torch.tensor([1.0 if p.requires_grad else 0.0], device=p.device)
            dist.all_reduce(trains, op=dist.ReduceOp.MIN, group=group)
            if trains.item() == 0.0:
                p.grad = None
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if not replicated:  # (a DTensor shard under fsdp: the same shard index on every owner)
                dist.all_reduce(_local(p.grad), group=group)
                continue
            dist.reduce(p.grad, dst=first, group=group)
            self._pending.append((p, group, first))
            if me != first:
                p.grad.zero_()  # not this owner's to exchange; share_gradients overwrites it

    def merge_local_gradients(self, layers: nn.ModuleList) -> None:
        """Users of a tied parameter on this rank that hold parameters of their own (fsdp's
        mirrors, runtime/fsdp_tied.py): their gradients added to the first user's and dropped,
        so the parameter has one gradient here, as the one object of ``replicate`` has."""
        for t in self.tied:
            users = [layers[i].get_parameter(name) for i, name in t.members if not isinstance(layers[i], RemoteLayer)]
            first = users[0] if users else None
            for other in users[1:]:
                if other is first or other.grad is None:
                    continue
                if first.grad is None:
                    first.grad = other.grad
                else:
                    first.grad += other.grad
                other.grad = None

    def averaged_once(self, params) -> list[nn.Parameter]:
        """``params`` without the tied parameters whose data-parallel exchange another owner
        does (after ``sync_gradients(replicated=True)``; every replica drops the same ones)."""
        me = dist.get_rank() if self._pending else -1
        skip = {id(p) for p, _, first in self._pending if first != me}
        return [p for p in params if id(p) not in skip]

    def share_gradients(self) -> None:
        """Send each tied gradient, averaged over the replicas by the first owner, to the other
        owners (after the data-parallel exchange; collective over each tied group)."""
        pending, self._pending = self._pending, []
        for p, group, first in pending:
            dist.broadcast(p.grad, src=first, group=group)

    def align(self, layers: nn.ModuleList, optimizers=()) -> None:
        """Make the copies one parameter again after the layers were (re)allocated, e.g. by a
        meta-device materialisation that allocates each layer on its own: on this rank every
        user of a tied parameter is tied to the first local user's object (the optimizers keep
        that one), and across ranks the copies take the values of the rank holding the first user
        (the layer whose initialisation a single process keeps). Collective over each group."""
        self.tie_local(layers, optimizers)
        with torch.no_grad():
            for t, group, first in self._sync:
                p = self.local_param(layers, t)
                if p is not None:
                    dist.broadcast(p.data, src=first, group=group)

    def tie_local(self, layers: nn.ModuleList, optimizers=(), only: set[int] | None = None) -> None:
        """On this rank, every user of a tied parameter tied to the first local user's object
        (its values kept; the others leave the optimizers). No communication. ``only``: just the
        tied parameters whose local users are all among these layers."""
        for t in self.tied:
            local = [(i, name) for i, name in t.members if not isinstance(layers[i], RemoteLayer)]
            if len(local) < 2 or (only is not None and any(i not in only for i, _ in local)):
                continue
            keep = layers[local[0][0]].get_parameter(local[0][1])
            for i, name in local[1:]:
                other = layers[i].get_parameter(name)
                if other is keep:
                    continue
                retie(layers[i], name, keep)
                for opt in optimizers:
                    opt = getattr(opt, "_optimizer", opt)
                    for group in opt.param_groups:
                        if any(p is other for p in group["params"]):
                            params = [keep if p is other else p for p in group["params"]]
                            group["params"] = [p for k, p in enumerate(params) if all(p is not q for q in params[:k])]
                    opt.state.pop(other, None)
