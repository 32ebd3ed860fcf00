"""Every schedule's facts in one table: torch class, stages per rank, layout, in-flight rule.

Each schedule is one of ``torch.distributed.pipelining``'s, named here by the string that
``torch.distributed.pipelining.schedules.get_schedule_class`` resolves (the runtime resolves
it; this module stays free of torch.distributed). The table also says how the cost model counts
activations in flight (``cost_schedule``) and which micro-batch counts the schedule accepts, so
bad input fails before any rank communicates.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    torch_class: str  # name for torch.distributed.pipelining.schedules.get_schedule_class
    multi: bool  # takes a list of local stages (virtual pipeline stages)
    cost_schedule: str  # the cost model's in-flight rule (see CostModel.inflight)
    v_shape: bool = False  # stage layout 0..p-1 then p-1..0 (ZBV) instead of round-robin
    fixed_virtual: int | None = None
    description: str = ""
    min_per_rank: int = 1  # micro-batches >= this x pipeline ranks (0: any count)
    rank_multiple: bool | None = None  # micro-batches a multiple of the ranks (None: where ``multi``)

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
        if requested is None:
            return 2
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got {requested!r}")
        return requested

    def rank_of_stage(self, stage: int, pp: int) -> int:
        if self.v_shape:
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def stages_of_rank(self, rank: int, pp: int, virtual: int) -> list[int]:
        return [s for s in range(pp * virtual) if self.rank_of_stage(s, pp) == rank]

    def min_microbatches(self, pp: int) -> int:
        """The fewest micro-batches this schedule runs on ``pp`` ranks."""
        return max(1, self.min_per_rank * pp)

    def check_microbatches(self, microbatches: int, pp: int) -> None:
        """Raise a ValueError naming the fix when this schedule cannot run ``microbatches``."""
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        k = self.min_per_rank
        if microbatches < k * pp:
            need = "as many micro-batches as pipeline ranks" if k == 1 else f"{k} micro-batches per pipeline rank"
            bound = f"pipeline_parallel={pp}" if k == 1 else f"{k} x pipeline_parallel={k * pp}"
            raise ValueError(
                f"schedule {self.name!r} needs at least {need}: got microbatches={microbatches} < {bound}. "
                f"Raise `microbatches` (>= 4 x stages keeps the bubble small) or use schedule='gpipe'."
            )
        multiple = self.multi if self.rank_multiple is None else self.rank_multiple
        if multiple and microbatches % pp:
            raise ValueError(
                f"schedule {self.name!r} needs microbatches to be a multiple of pipeline_parallel: "
                f"got {microbatches} with pipeline_parallel={pp}"
            )

    def valid_microbatches(self, batch_size: int, pp: int, virtual: int) -> list[int]:
        """Divisors of ``batch_size`` this schedule accepts on ``pp`` ranks, at most 4 x stages."""
        out = []
        for d in range(1, min(batch_size, 4 * pp * virtual) + 1):
            if batch_size % d:
                continue
            try:
                self.check_microbatches(d, pp)
            except ValueError:
                continue
            out.append(d)
        return out


def choose_microbatches(spec: ScheduleSpec, batch_size: int, pp: int, virtual: int, pinned: int | None) -> int:
    """Micro-batches for ``batch_size`` on ``pp`` ranks: ``pinned`` when the user set it, else the
    largest divisor of the batch that is at most 4 x stages and suits the schedule (so that after
    re-packing onto fewer ranks the micro-batches grow again)."""
    if pinned is not None:
        if batch_size % pinned:
            raise ValueError(
                f"batch size {batch_size} is not divisible by microbatches={pinned}; choose a batch size that "
                f"is a multiple of {pinned} or set microbatches to a divisor of {batch_size}"
            )
        spec.check_microbatches(pinned, pp)
        return pinned
    valid = spec.valid_microbatches(batch_size, pp, virtual)
    if not valid:
        raise ValueError(
            f"no micro-batch count divides batch size {batch_size} and suits schedule "
            f"{spec.name!r} with {pp} pipeline ranks; use a batch size that is a multiple of "
            f"{spec.min_microbatches(pp)}"
        )
    return max(valid)


_SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("gpipe", "GPipe", False, "gpipe", description="fill-drain (all forwards, then all backwards)",
                     min_per_rank=0),
        ScheduleSpec("1f1b", "1F1B", False, "1f1b", description="PipeDream-Flush: one forward, one backward"),
        ScheduleSpec("interleaved_1f1b", "Interleaved1F1B", True, "interleaved_1f1b",
                     description="Megatron interleaved 1F1B"),
        # breadth-first: every micro-batch's forward of a stage runs before the next stage's, so
        # a stage keeps all m activations alive, as under GPipe
        ScheduleSpec("looped_bfs", "LoopedBFS", True, "gpipe", description="breadth-first over virtual stages"),
        ScheduleSpec("zero_bubble", "InterleavedZeroBubble", True, "zero_bubble",
                     description="interleaved zero bubble (split dI/dW)"),
        ScheduleSpec("zbv", "ZBVZeroBubble", True, "zero_bubble", v_shape=True, fixed_virtual=2,
                     description="zero bubble, V layout"),
        # DeepSeek's DualPipeV: ZBV's layout, a forward of one stage paired with a backward of the
        # other (torch runs the pair one after the other); each stage keeps ZBV's activations in
        # flight (checked against torch's action lists in tests/unit/test_sim.py)
        ScheduleSpec("dualpipev", "DualPipeV", True, "zero_bubble", v_shape=True, fixed_virtual=2,
                     description="DeepSeek DualPipeV: V layout, paired forward/backward", min_per_rank=2,
                     rank_multiple=False),
    )
}


def available_schedules() -> list[str]:
    return sorted(_SCHEDULES)


def multi_stage_schedules() -> list[str]:
    return sorted(n for n, s in _SCHEDULES.items() if s.multi)


def get_schedule(name: str | ScheduleSpec) -> ScheduleSpec:
    if isinstance(name, ScheduleSpec):
        return name
    key = str(name).lower().replace("-", "_")
    if key not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(available_schedules())}")
    return _SCHEDULES[key]
