"""Pipeline schedules by name, with the stage-to-rank layout and the constraints of each.

Every schedule is one of ``torch.distributed.pipelining``'s; this module only knows which class
a name means, how many stages each rank holds, which rank holds which stage, and which
micro-batch counts the schedule accepts, so that bad input fails before any rank communicates.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    cls: type
    multi: bool  # takes a list of local stages (virtual pipeline stages)
    v_shape: bool = False  # stage layout 0..p-1 then p-1..0 (ZBV) instead of round-robin
    fixed_virtual: int | None = None
    description: str = ""

    def virtual_stages(self, requested: int | None) -> int:
        if not self.multi:
            if requested not in (None, 1):
                raise ValueError(
                    f"schedule {self.name!r} runs one stage per rank; virtual_stages={requested} needs "
                    f"one of {multi_stage_schedules()}"
                )
            return 1
        if self.fixed_virtual is not None:
            if requested not in (None, self.fixed_virtual):
                raise ValueError(
                    f"schedule {self.name!r} needs exactly {self.fixed_virtual} stages per rank, "
                    f"got virtual_stages={requested}"
                )
            return self.fixed_virtual
        v = 2 if requested is None else int(requested)
        if v < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {requested}")
        return v

    def rank_of_stage(self, stage: int, pp: int) -> int:
        if self.v_shape:
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def stages_of_rank(self, rank: int, pp: int, virtual: int) -> list[int]:
        return [s for s in range(pp * virtual) if self.rank_of_stage(s, pp) == rank]

    def check_microbatches(self, microbatches: int, pp: int) -> None:
        """Raise a ValueError naming the fix when this schedule cannot run ``microbatches``."""
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        if self.name == "gpipe":
            return
        if microbatches < pp:
            raise ValueError(
                f"schedule {self.name!r} needs at least as many micro-batches as pipeline ranks: "
                f"got microbatches={microbatches} < pipeline_parallel={pp}. Raise `microbatches` "
                f"(>= 4 x stages keeps the bubble small) or use schedule='gpipe'."
            )
        if self.multi and microbatches % pp:
            raise ValueError(
                f"schedule {self.name!r} needs microbatches to be a multiple of pipeline_parallel: "
                f"got {microbatches} with pipeline_parallel={pp}"
            )


_SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("gpipe", ScheduleGPipe, False, description="fill-drain (all forwards, then all backwards)"),
        ScheduleSpec("1f1b", Schedule1F1B, False, description="PipeDream-Flush: one forward, one backward"),
        ScheduleSpec("interleaved_1f1b", ScheduleInterleaved1F1B, True, description="Megatron interleaved 1F1B"),
        ScheduleSpec("looped_bfs", ScheduleLoopedBFS, True, description="breadth-first over virtual stages"),
        ScheduleSpec(
            "zero_bubble", ScheduleInterleavedZeroBubble, True, description="interleaved zero bubble (split dI/dW)"
        ),
        ScheduleSpec(
            "zbv", ScheduleZBVZeroBubble, True, v_shape=True, fixed_virtual=2, description="zero bubble, V layout"
        ),
    )
}


def available_schedules() -> list[str]:
    return sorted(_SCHEDULES)


def multi_stage_schedules() -> list[str]:
    return sorted(n for n, s in _SCHEDULES.items() if s.multi)


def get_schedule(name: str) -> ScheduleSpec:
    key = str(name).lower().replace("-", "_")
    if key not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(available_schedules())}")
    return _SCHEDULES[key]
