"""torch's own per-rank action order for a schedule, obtained without a process group.

Every torch.distributed.pipelining schedule computes the whole pipeline's compute order in its
constructor (``pipeline_order``: rank -> list of actions, ``None`` for idle slots), from nothing
but the stage count, the rank count and the micro-batch count. We construct the class named by
:mod:`lightning_dynmo.plan.schedules` with stand-in stage objects carrying exactly those numbers,
so the simulator replays what torch would run, including its 1F1B and GPipe
(``PipelineScheduleSingle._get_pipeline_order``). The multi-stage constructors also lower the
order to send/recv actions, which the simulator does not need and which dominates their cost at
scale (about 1 s for 32 ranks x 128 micro-batches); a subclass skips that lowering.

DualPipeV pairs a forward of one stage with a backward of the other in one ``OVERLAP_F_B``
action; torch's runtime runs its two sub-actions one after the other, and so does the replay.
Action kinds are read through torch's own constants (an ``Enum`` of ints on torch 2.10, of the
letters from 2.11 on).

torch 2.13's ``Schedule1F1B`` order numbers the last rank's forwards 1..m instead of 0..m-1 (the
order is only displayed by torch, never executed; its runtime loop is right), so a stage whose
actions of one kind are not micro-batches 0..m-1 once each is renumbered in order of appearance.
"""
from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import NamedTuple

from ..plan.schedules import get_schedule

COMPUTE = ("F", "B", "I", "W")  # forward, full backward, input-grad backward, weight-grad backward


class Op(NamedTuple):
    stage: int
    kind: str  # one of COMPUTE
    mb: int


def _order_only(cls: type) -> type:
    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": lambda self, *args, **kwargs: None})


@lru_cache(maxsize=64)
def schedule_ops(schedule: str, pp: int, virtual: int, microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """Compute actions of every pipeline rank in torch's order: ``ops[rank] = (Op, ...)``.

    ``schedule`` is a name from :func:`lightning_dynmo.plan.schedules.available_schedules`;
    ``virtual`` stages per rank as that table allows. Non-compute actions (``REDUCE_GRAD``) and
    idle slots are dropped: the replay derives waiting from dependencies."""
    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    kinds = {ts.FORWARD: "F", ts.FULL_BACKWARD: "B", ts.BACKWARD_INPUT: "I", ts.BACKWARD_WEIGHT: "W"}

    spec = get_schedule(schedule)
    virtual = spec.virtual_stages(virtual)
    spec.check_microbatches(microbatches, pp)
    cls = get_schedule_class(spec.torch_class)
    stages = [
        SimpleNamespace(num_stages=pp * virtual, group_size=pp, group_rank=0, submod=None)
        for _ in range(virtual)
    ]
    if issubclass(cls, PipelineScheduleMulti):
        order = _order_only(cls)(stages, n_microbatches=microbatches).pipeline_order
    else:
        order = cls(stages[0], n_microbatches=microbatches).pipeline_order
    ops = [[Op(a.stage_index, kinds[a.computation_type], a.microbatch_index) for a in _leaves(order[rank])
            if a.computation_type in kinds] for rank in range(pp)]
    return tuple(tuple(_numbered(rank_ops, microbatches)) for rank_ops in ops)


def _leaves(actions):
    """``actions`` without idle slots, an overlapped pair as its two sub-actions in order."""
    for a in actions:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        yield from subs if subs else (a,)


def _numbered(ops: list[Op], microbatches: int) -> list[Op]:
    """``ops`` with each stage's forwards, and its backwards (``B`` and ``I`` together: DualPipeV
    runs some micro-batches' backward whole and others' split), covering micro-batches 0..m-1 once
    (see module docstring). ``W`` keep torch's numbers (those of their ``I``)."""
    def family(op: Op) -> tuple[int, str]:
        return op.stage, "B" if op.kind == "I" else op.kind

    seen: dict[tuple[int, str], list[int]] = {}
    for op in ops:
        seen.setdefault(family(op), []).append(op.mb)
    broken = {key for key, mbs in seen.items() if key[1] != "W" and sorted(mbs) != list(range(microbatches))}
    count: dict[tuple[int, str], int] = {}
    out = []
    for op in ops:
        key = family(op)
        if key in broken:
            count[key] = count.get(key, 0) + 1
            op = op._replace(mb=count[key] - 1)
        out.append(op)
    return out
