"""One rebalance, re-pack or skipped decision as a value: what the policy decided and why, what
the cost model predicted, what the migration cost. Each is one line of
``rebalance_history.jsonl``; :meth:`Decision.from_record` reads one back."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decision:
    """One rebalance or re-pack decision; also one line of ``rebalance_history.jsonl``.

    ``applied`` says whether the partition changed; ``why`` says why (or why not). Fields that do
    not apply to a decision are ``None`` and left out of the JSON record."""

    step: int
    reason: str
    before: str
    applied: bool
    why: str
    kind: str = "rebalance"  # "rebalance", "repack" or "skip" (a trigger the budget or back-off let pass)
    balancer: str | None = None
    after: str | None = None
    rounds: int | None = None
    decision_ms: float | None = None
    predicted_step_before: float | None = None
    predicted_step_after: float | None = None
    imbalance_before: float | None = None
    imbalance_after: float | None = None
    bubble_before: float | None = None
    bubble_after: float | None = None
    migration_ms: float | None = None
    migration_bytes: int | None = None
    moved_layers: int | None = None
    ranks_before: int | None = None
    ranks_after: int | None = None
    microbatches: int | None = None
    released: tuple[int, ...] | None = None
    speeds: tuple[float, ...] | None = None  # per stage: the cost model's speed the decision balanced for
    straggler: str | None = None  # the slowest rank it balanced for, e.g. "pipeline rank 1 at 0.52x"

    def with_(self, **changes: Any) -> "Decision":
        return dataclasses.replace(self, **changes)

    def to_record(self) -> dict[str, Any]:
        """The JSON record: set fields only, tuples as lists."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Decision":
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in record.items() if k in names}
        return cls(**kw)
