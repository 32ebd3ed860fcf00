"""Stage boundaries as a first-class, validated value.

A partition of ``L`` ordered layers into ``S`` contiguous, non-empty stages is the tuple of
boundaries ``b[0] = 0 < b[1] < ... < b[S] = L``; stage ``s`` owns layers ``b[s] .. b[s+1]-1``.
Balancers return one, the migration planner diffs two, the engine builds stages from one.
Because a partition is only boundaries, it cannot express a reordering of layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Partition:
    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        b = tuple(int(x) for x in self.boundaries)
        object.__setattr__(self, "boundaries", b)
        if len(b) < 2:
            raise ValueError(f"a partition needs at least one stage, got boundaries {b}")
        if b[0] != 0:
            raise ValueError(f"partition boundaries must start at 0, got {b}")
        for s in range(len(b) - 1):
            if b[s + 1] <= b[s]:
                raise ValueError(
                    f"partition boundaries must be strictly increasing (no empty stage), got {b}"
                )

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> "Partition":
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + int(n))
        return cls(tuple(bounds))

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        return self.boundaries[-1]

    @property
    def sizes(self) -> tuple[int, ...]:
        b = self.boundaries
        return tuple(b[s + 1] - b[s] for s in range(self.num_stages))

    def layers_of(self, stage: int) -> range:
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_of(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        lo, hi = 0, self.num_stages - 1
        while lo < hi:  # last stage whose start <= layer
            mid = (lo + hi + 1) // 2
            if self.boundaries[mid] <= layer:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def owner_map(self) -> list[int]:
        """``owner[layer] = stage`` for every layer."""
        return [s for s in range(self.num_stages) for _ in self.layers_of(s)]

    def moved_layers(self, other: "Partition") -> int:
        """How many layers change stage between ``self`` and ``other`` (same L and S)."""
        if other.num_layers != self.num_layers or other.num_stages != self.num_stages:
            raise ValueError(f"cannot compare {self} with {other}: different layer/stage counts")
        return sum(a != b for a, b in zip(self.owner_map(), other.owner_map()))

    def __iter__(self) -> Iterator[range]:
        return (self.layers_of(s) for s in range(self.num_stages))

    def __str__(self) -> str:
        return "|".join(f"{r.start}-{r.stop - 1}" for r in self)
