"""Expert parallelism across the data-parallel replicas of a pipeline stage.

``DynMoStrategy(expert_parallel=ep)``: the ``dp`` replicas of each stage (the ranks that hold the
same layers in different pipelines) form ``dp / ep`` *expert-parallel groups* of ``ep`` adjacent
replicas (by data-parallel index). Replica ``d`` holds shard ``d % ep`` of every expert layer it
owns: experts ``[k n, (k + 1) n)`` with ``n = num_experts / ep``.

Forward of a sharded expert layer (:func:`run_sharded_experts`), per micro-batch:

1. each replica routes its own tokens and sorts them by expert (as without sharding);
2. tokens-per-expert counts are gathered (one ``all_gather`` of ``[num_experts]`` per peer), so
   every replica knows how many rows every peer sends to every expert: what it sends to and
   receives from each peer, and what every shard of the group receives (:func:`shard_slots`, the
   layer's load signal: the token exchange waits for the busiest shard);
3. tokens go to their expert's owner (``all_to_all_single`` with uneven splits, gloo and NCCL),
   are regrouped by local expert, run through the local experts, and come back the same way.

Both token exchanges are :class:`_AllToAll`, whose backward is the reverse exchange, so the
gradient of every expert output reaches the owner and the gradient of every input its sender.
All replicas of a stage run the same schedule over the same layers, so these collectives line
up in the same order on every member of a group, in forward and in backward.

Gradients: an expert shard's owner receives the summed gradient of the ``ep`` replicas of its
group; averaging over the data-parallel group would mix different experts, so expert shards are
instead summed over the ``dp / ep`` replicas holding the *same* shard and divided by ``dp``
(:class:`ExpertShards`), which is the data-parallel mean of single-process training. Under
``dp_sharding="fsdp"`` the experts are reduced the same way and only the dense parameters are
FSDP-sharded over the replicas (``runtime/fsdp.py``).

Layer migration moves a layer from replica ``d`` of one stage to replica ``d`` of another (each
replica's pipeline migrates on its own), so a shard keeps its index and moves with its
optimizer state like any parameter. Checkpoints are gathered to whole ``[num_experts, ...]``
tensors on save and sliced on load (``strategy/checkpoint.py``), so they stay in single-process
format.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..plan.topology import Topology
from ..protocol.services import ExpertShard, ShardsExperts, set_expert_dispatch
from .optimizer_layout import OptimizerLayout

__all__ = [
    "ExpertParallel",
    "ExpertShards",
    "check_expert_parallel",
    "check_expert_parallel_model",
    "expert_modules",
    "run_sharded_experts",
    "shard_slots",
]


def expert_modules(module: nn.Module) -> list[tuple[str, ShardsExperts]]:
    """``(qualified name, module)`` of every expert module inside ``module``."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, ShardsExperts)]


def check_expert_parallel(ep: int, dp: int) -> None:
    """``ep`` must divide the data-parallel size (raises naming the fix)."""
    if ep > 1 and dp % ep:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(
            f"expert_parallel={ep} must divide the {dp} data-parallel replicas (devices x num_nodes / "
            f"pipeline_parallel): each stage's experts are split over groups of expert_parallel replicas. "
            f"Use expert_parallel in {divisors}, or change devices/pipeline_parallel"
        )


def check_expert_parallel_model(module: nn.Module, ep: int) -> None:
    """With ``ep > 1`` the model must have expert layers whose expert count ``ep`` divides."""
    if ep == 1:
        return
    found = expert_modules(module)
    if not found:
        raise ValueError(
            f"expert_parallel={ep}, but {type(module).__name__} has no expert layers (modules like GroupedExperts "
            "that implement ShardsExperts) to shard; use expert_parallel=1 or an MoE model"
        )
    skipping = [name for name, m in module.named_modules() if getattr(m, "may_skip_expert_exchange", False)]
    if skipping:
        raise ValueError(
            f"expert_parallel={ep} cannot run {skipping[0]}: a block that may pick no token of a micro-batch (MoD "
            "predictor or threshold routing) would skip its MoE layer's token exchange on one replica while the "
            "others wait for it; use MoD routing='expert_choice' for blocks with MoE MLPs, or expert_parallel=1"
        )
    bad = sorted({m.num_experts for _, m in found if m.num_experts % ep})
    if bad:
        raise ValueError(
            f"expert_parallel={ep} must divide the number of experts of every MoE layer, but layers have "
            f"num_experts={bad}; use an expert_parallel that divides {bad[0]}"
        )


class ExpertShards(NamedTuple):
    """What gradient averaging and clipping need about this rank's expert shards: the shard
    parameters (by id), the group of the replicas holding the other shards of the same layers
    (``peers``), and the group of those holding the same shard (``same_shard``, ``None`` when it
    is this rank alone)."""

    params: frozenset[int]
    peers: object
    same_shard: object


def _groups_of_stage(topo: Topology, ep: int, stage: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of the expert-parallel groups (blocks of ``ep`` adjacent replicas) of
    ``stage`` and of its same-shard groups (every ``ep``-th replica)."""
    replicas = topo.replica_ranks(stage)
    peers = [replicas[b * ep:(b + 1) * ep] for b in range(topo.dp // ep)]
    same = [replicas[k::ep] for k in range(ep)]
    return peers, same


class ExpertParallel:
    """This rank's expert-parallel setting: its shard and its two process groups (see the module
    docstring). :meth:`build` creates every group of the world (all ranks call it in the same
    order) and makes this the process's active setting, which sharded expert layers read in
    forward (a layer does not own a process group: it may migrate to another stage)."""

    def __init__(self, shard: ExpertShard, peers, same_shard, same_shard_size: int) -> None:
        self.shard = shard
        self.peers = peers
        self.same_shard = same_shard if same_shard_size > 1 else None

    @classmethod
    def build(cls, topo: Topology, ep: int, rank: int, timeout: timedelta) -> "ExpertParallel | None":
        check_expert_parallel(ep, topo.dp)
        if ep == 1:
            set_expert_dispatch(None)
            return None
        mine = None
        for stage in range(topo.pp):
            peers, same = _groups_of_stage(topo, ep, stage)
            peer_groups = [dist.new_group(r, timeout=timeout) for r in peers]
            same_groups = [dist.new_group(r, timeout=timeout) if len(r) > 1 else None for r in same]
            if topo.pp_rank(rank) == stage:
                d = topo.dp_rank(rank)
                mine = cls(ExpertShard(d % ep, ep), peer_groups[d // ep], same_groups[d % ep], topo.dp // ep)
        set_expert_dispatch(mine)
        return mine

    @property
    def size(self) -> int:
        return self.shard.size

    def dispatch(self, local: Callable[[Tensor, Tensor], Tensor], x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """The sharded experts' forward (:class:`~lightning_dynmo.protocol.DispatchesExperts`):
        :func:`run_sharded_experts` over this rank's group."""
        return run_sharded_experts(local, x, counts, self)

    def sharded_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """``{qualified name: parameter}`` of the expert shards ``module`` holds, in name order."""
        out = {}
        for prefix, m in expert_modules(module):
            if m.expert_shard is not None:
                for name, p in m.named_parameters(recurse=False):
                    out[f"{prefix}.{name}" if prefix else name] = p
        return dict(sorted(out.items()))

    def shards(self, module: nn.Module) -> ExpertShards:
        params = frozenset(id(p) for p in self.sharded_parameters(module).values())
        return ExpertShards(params, self.peers, self.same_shard)

    def shard_module(self, module: nn.Module, optimizers=(), layout: OptimizerLayout | None = None,
                     prefix: str = "") -> None:
        """Keep only this rank's shard in every expert module of ``module`` (idempotent); the
        ``optimizers`` (placed by ``layout``) then hold the shards in place of the whole parameters.
        ``prefix``: ``module``'s qualified name in the LightningModule, with its trailing dot."""
        for path, m in expert_modules(module):
            for name, old, new in m.shard_experts(self.shard):
                if optimizers:
                    layout.replace_param(optimizers, prefix + (f"{path}.{name}" if path else name), old, new)

    def gather(self, tensors: dict, device: torch.device) -> dict:
        """Whole ``[num_experts, ...]`` CPU tensors from every peer's shard of ``tensors``
        (collective over the peers; every peer passes the same names and shapes)."""
        out = {}
        for name in sorted(tensors):
            local = tensors[name].detach().to(device).contiguous()
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(parts, local, group=self.peers)
            out[name] = torch.cat(parts).cpu()
        return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def shard_slots(sent: Tensor, size: int) -> Tensor:
    """Rows each of the ``size`` shards of an expert-parallel group receives, ``[size]``, from
    ``sent [size, num_experts]``: the rows each peer sends to each (global) expert. Shard ``j``
    holds experts ``[j n, (j + 1) n)``, so it receives column block ``j`` summed over peers."""
    return sent.reshape(size, size, -1).sum(dim=(0, 2))


# torch >= 2.12 names it all_gather_single; older releases (2.4-2.11, e.g. CUDA images) only have
# all_gather_into_tensor, the same collective under its earlier name
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def run_sharded_experts(local: Callable[[Tensor, Tensor], Tensor], x: Tensor, counts: Tensor,
                        ep: ExpertParallel) -> tuple[Tensor, Tensor]:
    """Experts of a sharded layer on tokens ``x`` sorted by global expert (``counts [E]`` rows
    each): dispatch to the owners, ``local(tokens, local_counts)`` on this rank's experts
    (tokens sorted by local expert), combine back. Returns ``x``'s rows' outputs in ``x``'s order
    and the rows every shard of the group received (:func:`shard_slots`, same on every peer)."""
    size, me = ep.size, ep.shard.rank
    n = counts.numel() // size
    sent = counts.new_empty(size * counts.numel())
    _all_gather_flat(sent, counts.contiguous(), group=ep.peers)  # row p: peer p's rows per expert
    sent = sent.view(size, size * n)
    received = sent[:, me * n:(me + 1) * n]  # row j: peer j's rows per local expert
    send = counts.view(size, n).sum(1).tolist()
    recv = received.sum(1).tolist()
    tokens = _AllToAll.apply(x, recv, send, ep.peers)
    # rows arrive by source peer, then local expert; the experts want them by local expert, then source
    key = torch.arange(n, device=x.device).mul(size).view(1, n) + torch.arange(size, device=x.device).view(size, 1)
    order = torch.argsort(torch.repeat_interleave(key.reshape(-1), received.reshape(-1)), stable=True)
    y = local(tokens[order], received.sum(0))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(y[inverse], send, recv, ep.peers), shard_slots(sent, size)
