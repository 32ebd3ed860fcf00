"""A GPT's per-layer costs at one point of training (:class:`Snapshot`), built from a profile:
``[embedding] + blocks + [final norm, head]`` as :class:`~lightning_dynmo.models.GPT` lays it out."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...plan.cost_model import LayerCosts
from .profile import Profile

BYTES_PER_PARAM_STATE = 16.0  # bf16 weight + bf16 grad + fp32 master + 2 fp32 Adam moments


@dataclass(frozen=True)
class Snapshot:
    """The model's per-layer costs during ``iterations`` training iterations."""

    costs: LayerCosts  # time view: activation = bytes crossing a stage boundary
    iterations: float
    stored_activation: tuple[float, ...]  # bytes per layer kept for backward per micro-batch
    reduced_params: tuple[int, ...] | None = None  # data-parallel all-reduce (None: costs.params)
    label: str = ""

    def memory_view(self) -> LayerCosts:
        """Same layers with ``activation`` = stored bytes (for memory-capacity checks only)."""
        c = self.costs
        return LayerCosts(c.forward, c.backward, c.params, c.memory, self.stored_activation)


def gpt_snapshot(profile: Profile, blocks: Sequence[tuple[float, float]], *, iterations: float = 1.0,
                 block_params: Sequence[int] | None = None, frozen: Sequence[bool] | None = None,
                 embedding_frozen: bool = False, label: str = "") -> Snapshot:
    """``[embedding] + blocks + [final norm, head]`` from per-block (forward, backward) seconds.

    ``block_params``: what each block holds (default: the profile's dense block); ``frozen``:
    blocks whose gradients are not all-reduced (their backward is already in ``blocks``)."""
    n = len(blocks)
    bp = [profile.block_params()] * n if block_params is None else [int(p) for p in block_params]
    emb_p, norm_p, head_p = (int(profile.params.get(k, 0)) for k in ("embedding", "final_norm", "head"))
    fwd = [profile.embedding[0], *(f for f, _ in blocks), profile.final_norm[0], profile.head[0]]
    bwd = [0.0 if embedding_frozen else profile.embedding[1], *(b for _, b in blocks), profile.final_norm[1],
           profile.head[1]]
    params = [emb_p, *bp, norm_p, head_p]
    frozen = [False] * n if frozen is None else list(frozen)
    reduced = tuple([0 if embedding_frozen else emb_p, *(0 if fz else p for fz, p in zip(frozen, bp)), norm_p, head_p])
    edge = profile.boundary_bytes
    stored = (profile.boundary_bytes, *[profile.stored_block_bytes] * n, profile.boundary_bytes,
              profile.stored_head_bytes)
    costs = LayerCosts(fwd, bwd, params, [BYTES_PER_PARAM_STATE * p for p in params], [edge] * (n + 3))
    return Snapshot(costs, float(iterations), stored, None if reduced == tuple(params) else reduced, label)
