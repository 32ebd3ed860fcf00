"""Tied parameters (a GPT-2-style embedding and LM head) under ``dp_sharding="fsdp"``.

Across stages nothing is special: each stage's unit shards its copy ``Shard(0)`` over its own
replicas, and every stage has the same number of replicas in the same mesh order, so dp rank ``r``
of either stage holds the same rows. After each stage's reduce-scatter (the replicas' average),
the tied group of replica ``r`` (:class:`~lightning_dynmo.runtime.tied.TiedParameters`: the ranks
of that replica's pipeline holding the parameter) sums its shards, once per shard.

On one rank (both ends in one stage after a migration or a repack, or in two stages of a V
schedule) one parameter would sit in two FSDP units, which FSDP2 refuses (a parameter belongs to
one unit), while each pipeline layer must stay a unit of its own (it migrates alone). So every
local user after the first gets its own parameter, a *mirror*, whose shard is the first user's
shard (the same storage, :func:`share_mirror_shards`): the optimizer holds the first user's
parameter only and updates it in place, so the mirror's all-gather reads the same values, and
loading a checkpoint into either key writes both. The mirror's reduce-scattered gradient is added
to the first user's and dropped after each batch (:meth:`TiedParameters.merge_local_gradients`),
so the optimizer, the tied group's sum and clipping see the parameter once. A migration makes a
moving layer's local partners whole with it (:func:`tied_partners`): in the plain world the
users are one parameter again, as under ``replicate``, the unchanged migration code moves or keeps
it, and the layers are sharded again afterwards.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..protocol import RemoteLayer
from .tied import TiedParameters, retie


def _local_users(tied: TiedParameters, layers: nn.ModuleList):
    """``(tied parameter, its local users)`` for each tied parameter with more than one here."""
    for t in tied.tied:
        users = [(i, name) for i, name in t.members if not isinstance(layers[i], RemoteLayer)]
        if len(users) > 1:
            yield t, users


def tied_partners(tied: TiedParameters, layers: nn.ModuleList, indices: Iterable[int]) -> set[int]:
    """The local layers that share a tied parameter with a layer in ``indices`` (local or not)."""
    indices = set(indices)
    out: set[int] = set()
    for t in tied.tied:
        if indices & set(t.layers):
            out |= {i for i in t.layers if not isinstance(layers[i], RemoteLayer)}
    return out - indices


def untie_before_sharding(tied: TiedParameters, layers: nn.ModuleList, i: int) -> None:
    """Give layer ``i`` a fresh copy of each tied parameter that a local layer before it uses
    first, so that ``fully_shard`` makes it a parameter of its own (the mirror; FSDP2 refuses a
    parameter object it has sharded once). The copy has no gradient (the first user keeps it)
    and is in no optimizer."""
    for _, users in _local_users(tied, layers):
        for j, name in users[1:]:
            if j == i:
                p = layers[i].get_parameter(name)
                retie(layers[i], name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def _fsdp_param(unit: nn.Module, param: nn.Parameter):
    for group in getattr(fully_shard.state(unit), "_fsdp_param_groups", None) or ():
        for fp in getattr(group, "fsdp_params", ()):
            if getattr(fp, "sharded_param", None) is param:
                return fp
    raise RuntimeError(f"torch {torch.__version__}: FSDP2 keeps a unit's parameters elsewhere than dp_sharding='fsdp' "
                       "looks for a tied parameter's shard (FSDPState._fsdp_param_groups[i].fsdp_params[j]"
                       ".sharded_param); use dp_sharding='replicate' for tied parameters with this torch")


def share_mirror_shards(tied: TiedParameters, layers: nn.ModuleList) -> None:
    """Make every mirror's shard its first user's (see the module docstring); tied parameters
    with a local user still whole are left for its sharding."""
    for t, users in _local_users(tied, layers):
        if not all(isinstance(layers[i], FSDPModule) for i, _ in users):
            continue
        first = layers[users[0][0]].get_parameter(users[0][1])
        source = _fsdp_param(layers[users[0][0]], first)
        for i, name in users[1:]:
            mirror = layers[i].get_parameter(name)
            if mirror is first or mirror._local_tensor is first._local_tensor:
                continue
            if tuple(mirror.shape) != tuple(first.shape) or mirror.placements != first.placements:
                raise RuntimeError(f"tied parameter {t.canonical}: its users on this rank are sharded differently "
                                   f"({list(first.placements)} and {list(mirror.placements)})")
            fp = _fsdp_param(layers[i], mirror)
            fp._sharded_param_data = source._sharded_param_data
            mirror._local_tensor = first._local_tensor
