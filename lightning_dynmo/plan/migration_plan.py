"""Which layer moves from which rank to which when the partition changes (pure).

Used by rebalancing (same stage count) and re-packing (fewer ranks); the runtime's executor
carries the plan out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .partition import Partition


@dataclass(frozen=True)
class LayerMove:
    layer: int
    src: int  # pipeline rank that owns the layer now
    dst: int  # pipeline rank that owns it afterwards
    src_stage: int
    dst_stage: int

    @property
    def adjacent(self) -> bool:
        """True when the stages are neighbours; otherwise the layer skips the ranks in between
        (it is sent directly, not relayed)."""
        return abs(self.dst_stage - self.src_stage) <= 1


@dataclass(frozen=True)
class MigrationPlan:
    old: Partition
    new: Partition
    moves: tuple[LayerMove, ...]

    @classmethod
    def build(
        cls,
        old: Partition,
        new: Partition,
        rank_of_stage: Callable[[int], int],
        new_rank_of_stage: Callable[[int], int] | None = None,
    ) -> "MigrationPlan":
        """Moves that turn ``old`` into ``new``. The stage counts may differ (re-packing onto
        fewer ranks); ``new_rank_of_stage`` maps the new partition's stages when they do."""
        if old.num_layers != new.num_layers:
            raise ValueError(f"partitions cover different layer counts: {old} vs {new}")
        new_rank_of_stage = new_rank_of_stage or rank_of_stage
        old_owner, new_owner = old.owner_map(), new.owner_map()
        moves = []
        for i, (a, b) in enumerate(zip(old_owner, new_owner)):
            ra, rb = rank_of_stage(a), new_rank_of_stage(b)
            if ra != rb:
                moves.append(LayerMove(i, ra, rb, a, b))
        return cls(old, new, tuple(moves))

    def describe(self) -> str:
        if not self.moves:
            return f"{self.old} -> {self.new}: nothing moves"
        parts = []
        for m in self.moves:
            note = "" if m.adjacent else f" (non-adjacent: stage {m.src_stage}->{m.dst_stage}, sent directly)"
            parts.append(f"layer {m.layer}: rank {m.src}->{m.dst}{note}")
        return f"{self.old} -> {self.new}: " + "; ".join(parts)
