"""Cost model: per-layer costs -> per-stage time and memory under a pipeline schedule.

Shared by the balancers, the runtime and the simulator, so that "the load of a stage" is one
number everywhere. Segment sums are *exact*: every per-layer value is turned into an integer
multiple of a common power of two, prefix sums are exact Python ints, and a segment sum is their
difference divided once (correctly rounded). A stage's load therefore does not depend on how or
in which order anyone summed it, is monotone in both boundaries, and balancers can compare loads
with ``==``/``<`` without epsilons.

Conventions (the runtime must profile accordingly):

* ``forward``/``backward``: seconds per micro-batch of one layer.
* ``activation[l]``: bytes of the tensor layer ``l`` outputs per micro-batch. Used twice: (a) it is
  what crosses the link when ``l`` ends a stage, and (b) it is what a stage keeps alive per
  in-flight micro-batch for backward (sum over the stage's layers).
* Receive cost: stage ``s > 0`` pays ``2 * activation[b[s] - 1] / bandwidth`` per micro-batch, i.e.
  the forward activation coming in plus the gradient of the same size going back over the same
  link. It is charged to the *receiving* stage, so a slow link looks like a heavier stage.
  ``bandwidth`` is one value for every boundary, or one per stage boundary: ``bandwidth[s]`` is the
  link between stages ``s`` and ``s + 1`` (what stage ``s + 1`` receives on; ``num_stages - 1``
  values, ``inf`` for a free boundary), e.g. NVLink inside a node and InfiniBand between nodes.
  With virtual stages the boundaries are those of the partition's (virtual) stages; whoever knows
  the placement maps them to rank pairs (:func:`lightning_dynmo.sim.simulate.boundary_links`,
  :meth:`lightning_dynmo.plan.layout.PipelineLayout.boundary_bandwidth`).
* Activation checkpointing (``CostModel.recompute``: the layers run under checkpointing): a
  recomputed layer costs one extra forward per micro-batch (its backward recomputes it first) and
  keeps nothing in flight; while its backward runs, one micro-batch of its activations is alive
  again, so a stage with recomputed layers also holds the largest of their ``activation`` once.
  ``backward`` stays the layer's plain backward: costs profiled *with* checkpointing already
  contain the recompute and go with ``recompute=frozenset()``.
* Rank speed (``CostModel.speed``): a layer's ``forward``/``backward`` are its *work*, the seconds
  it takes on a rank of speed 1.0; on stage ``s`` it takes ``work / speed[s]`` (one value per
  partition stage: its rank's speed, the slowest replica's with data parallelism; see
  :mod:`lightning_dynmo.plan.speed`). Receive times are the link's and do not scale. ``None`` (the
  default) is every stage at 1.0, bit for bit: measured times are then taken as the work itself.
"""
from __future__ import annotations

import math
from numbers import Real
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Callable, Iterable, Sequence, TypedDict

from .partition import Partition

#: Schedules the cost model knows, mapped to how they keep activations in flight.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
#: Model chunks per rank assumed for ``interleaved_1f1b`` (Megatron / torch default of 2).
INTERLEAVED_CHUNKS = 2


class _ExactPrefix:
    """Exact prefix sums of non-negative finite numbers; ``sum(i, j)`` is correctly rounded."""

    __slots__ = ("p", "den")

    def __init__(self, *columns: Sequence[float | int]) -> None:
        ratios = [[x.as_integer_ratio() for x in col] for col in columns]
        den = max((d for col in ratios for _, d in col), default=1)
        acc = 0
        p = [0]
        for row in zip(*ratios):
            for n, d in row:
                acc += n * (den // d)
            p.append(acc)
        self.p: list[int] = p
        self.den: int = den

    def sum(self, start: int, stop: int) -> float:
        return (self.p[stop] - self.p[start]) / self.den


def _as_floats(name: str, values: Iterable[float]) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"LayerCosts.{name}[{i}] must be finite and >= 0, got {v}")
    return out


@dataclass(frozen=True)
class LayerCosts:
    """Profiled per-layer costs; all sequences have one entry per layer (see module docstring)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    params: tuple[int, ...]
    memory: tuple[float, ...]
    activation: tuple[float, ...]

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "params":
                raw = tuple(self.params)
                vals: tuple[float, ...] = tuple(int(v) for v in raw)
                for i, (r, v) in enumerate(zip(raw, vals)):
                    if v != r or v < 0:
                        raise ValueError(f"LayerCosts.params[{i}] must be an int >= 0, got {r!r}")
            else:
                vals = _as_floats(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, vals)
        lengths = {f.name: len(getattr(self, f.name)) for f in fields(self)}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"LayerCosts sequences must have equal lengths, got {lengths}")
        if lengths["forward"] == 0:
            raise ValueError("LayerCosts needs at least one layer")

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        *,
        forward: float = 1.0,
        backward: float = 2.0,
        params: int = 1,
        memory: float = 0.0,
        activation: float = 0.0,
    ) -> "LayerCosts":
        """Identical layers (default: backward = 2 x forward, no memory or transfer cost)."""
        n = int(num_layers)
        return cls((forward,) * n, (backward,) * n, (params,) * n, (memory,) * n, (activation,) * n)

    @classmethod
    def from_params(
        cls,
        params: Sequence[int],
        *,
        seconds_per_param: float = 1e-9,
        backward_ratio: float = 2.0,
        memory: Sequence[float] | None = None,
        activation: float | Sequence[float] = 0.0,
    ) -> "LayerCosts":
        """Estimate from parameter counts: time proportional to params (the DeepSpeed proxy).
        ``memory``: each layer's bytes as the runtime counts them
        (:func:`~lightning_dynmo.runtime.memory.layer_state_bytes`, the one rule); ``None``:
        not known, 0 (no memory cap binds)."""
        params = tuple(int(p) for p in params)
        act = (float(activation),) * len(params) if isinstance(activation, (int, float)) else activation
        fwd = tuple(p * seconds_per_param for p in params)
        mem = tuple(float(m) for m in memory) if memory is not None else (0.0,) * len(params)
        return cls(fwd, tuple(f * backward_ratio for f in fwd), params, mem, tuple(act))

    @property
    def num_layers(self) -> int:
        return len(self.forward)

    @property
    def time(self) -> tuple[float, ...]:
        """Forward + backward seconds per micro-batch of each layer."""
        return tuple(f + b for f, b in zip(self.forward, self.backward))

    # Exact prefix sums, built once per (immutable) instance.
    @cached_property
    def _time_prefix(self) -> _ExactPrefix:
        return _ExactPrefix(self.forward, self.backward)

    @cached_property
    def _memory_prefix(self) -> _ExactPrefix:
        return _ExactPrefix(self.memory)

    @cached_property
    def _activation_prefix(self) -> _ExactPrefix:
        return _ExactPrefix(self.activation)

    @cached_property
    def _params_prefix(self) -> list[int]:
        acc, p = 0, [0]
        for x in self.params:
            acc += x
            p.append(acc)
        return p

    def time_sum(self, start: int, stop: int) -> float:
        """Exact (correctly rounded) fwd+bwd seconds of layers ``start..stop-1``."""
        return self._time_prefix.sum(start, stop)

    def memory_sum(self, start: int, stop: int) -> float:
        return self._memory_prefix.sum(start, stop)

    def activation_sum(self, start: int, stop: int) -> float:
        return self._activation_prefix.sum(start, stop)

    def params_sum(self, start: int, stop: int) -> int:
        p = self._params_prefix
        return p[stop] - p[start]

    def stage_params(self, partition: Partition) -> list[int]:
        self._check(partition)
        b = partition.boundaries
        return [self.params_sum(b[s], b[s + 1]) for s in range(partition.num_stages)]

    def _check(self, partition: Partition) -> None:
        if partition.num_layers != self.num_layers:
            raise ValueError(
                f"partition {partition} covers {partition.num_layers} layers, costs have {self.num_layers}"
            )


def imbalance(loads: Sequence[float]) -> float:
    """(max - min) / mean; 0 for an empty or all-zero load vector."""
    if not loads:
        return 0.0
    mean = math.fsum(loads) / len(loads)
    return 0.0 if mean == 0 else (max(loads) - min(loads)) / mean


def _check_speed(speed: object) -> tuple[float, ...] | None:
    """None, or one speed factor per stage, each finite and > 0."""
    if speed is None:
        return None
    if isinstance(speed, (str, bytes)) or not isinstance(speed, Iterable):
        raise ValueError(f"speed must be None or one factor per stage (a sequence of floats > 0), got {speed!r}")
    values = tuple(speed)
    for i, v in enumerate(values):
        # typeshed's numbers.Real declares __lt__/__le__ only; float, int, Fraction and numpy's have __gt__
        if not isinstance(v, Real) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):  # type: ignore[operator]
            raise ValueError(f"speed[{i}] must be a finite number > 0 (1.0: a rank of reference speed), got {v!r}")
    if not values:
        raise ValueError("speed needs one factor per stage (None: every stage at 1.0)")
    return tuple(float(v) for v in values)


def _check_bandwidth(bw: Any) -> float | tuple[float, ...] | None:
    """None, one float, or a tuple of per-boundary floats, each > 0 (``inf``: free)."""
    if bw is None:
        return None
    seq = isinstance(bw, Iterable) and not isinstance(bw, (str, bytes))
    values = tuple(bw) if seq else (bw,)
    for i, v in enumerate(values):
        if not isinstance(v, Real) or isinstance(v, bool) or not float(v) > 0:
            at = f"[{i}]" if seq else ""
            raise ValueError(f"bandwidth{at} must be > 0 bytes/s (inf: free), one per stage boundary or one for all, "
                             f"or None; got {v!r}")
    if not values:
        raise ValueError("bandwidth per stage boundary needs at least one value (a single stage: pass None)")
    return tuple(float(v) for v in values) if seq else float(bw)


class _RecomputePrefix(TypedDict):
    """What :meth:`CostModel._prefixes` caches for one ``costs`` instance."""

    costs: LayerCosts
    time: _ExactPrefix
    kept_activation: _ExactPrefix


@dataclass(frozen=True)
class CostModel:
    """How a schedule turns per-layer costs into per-stage time and memory."""

    microbatches: int
    schedule: str = "1f1b"
    # bytes/s between adjacent stages: one value, one per stage boundary, or None = free transfers
    bandwidth: float | tuple[float, ...] | None = None
    capacity: float | None = None  # bytes per stage; None = unlimited
    virtual_stages: int = 1  # stages per rank; >1: the partition's stages are virtual stages
    recompute: frozenset[int] = frozenset()  # layers under activation checkpointing
    speed: tuple[float, ...] | None = None  # per stage: work / speed = seconds (None: all 1.0)
    _recompute_prefix: dict[int, _RecomputePrefix] = field(default_factory=dict, init=False, repr=False, compare=False,
                                                           hash=False)

    def __post_init__(self) -> None:
        rc = self.recompute
        if isinstance(rc, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                    for i in rc):
            raise ValueError(f"recompute must be a set of layer indices (ints >= 0), got {rc!r}")
        object.__setattr__(self, "recompute", frozenset(rc))
        m = self.microbatches
        if isinstance(m, bool) or int(m) != m or m < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {m!r}")
        object.__setattr__(self, "microbatches", int(m))
        sched = str(self.schedule).lower().replace("-", "_")
        if sched not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        object.__setattr__(self, "schedule", sched)
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
        object.__setattr__(self, "bandwidth", _check_bandwidth(self.bandwidth))
        object.__setattr__(self, "speed", _check_speed(self.speed))
        cap = self.capacity
        if cap is not None:
            cap = float(cap)
            if not cap > 0 or math.isnan(cap):
                raise ValueError(f"capacity must be > 0 or None, got {cap}")
            object.__setattr__(self, "capacity", cap)

    # ---- memory -------------------------------------------------------------------------
    def inflight(self, stage: int, num_stages: int) -> int:
        """Micro-batches whose activations ``stage`` (0-based) holds at peak.

        gpipe: all m. 1f1b / zero_bubble (ZB-H1 keeps 1F1B's memory): min(m, p - stage).
        interleaved_1f1b: the stage is one rank holding INTERLEAVED_CHUNKS=v equal chunks of its
        layers; torch/Megatron warm up (v-1)p + 2(p-1-stage) chunk micro-batches, so at peak
        (v-1)p + 2(p-1-stage) + 1 chunk activations = that / v stage activations, rounded up
        (conservative), capped at m. With ``virtual_stages=v > 1`` the partition's stages are the
        virtual stages themselves (stage s on rank s mod p of p = num_stages / v), and each holds
        the same per-chunk share of its rank's warm-up.
        """
        p, m = int(num_stages), self.microbatches
        if p < 1 or not 0 <= stage < p:
            raise ValueError(f"stage {stage} outside 0..{p - 1}")
        if self.schedule == "gpipe":
            return m
        if self.schedule == "interleaved_1f1b":
            v = INTERLEAVED_CHUNKS
            rank = stage
            if self.virtual_stages > 1 and p % self.virtual_stages == 0:
                v = self.virtual_stages
                p = p // v
                rank = stage % p
            chunks = (v - 1) * p + 2 * (p - 1 - rank) + 1
            return min(m, -(-chunks // v))
        return min(m, p - stage)

    def segment_memory(self, costs: LayerCosts, start: int, stop: int, stage: int, num_stages: int) -> float:
        """Peak bytes if layers ``start..stop-1`` form stage ``stage`` of ``num_stages``.
        Recomputed layers keep no activations in flight; the largest of them is alive once while
        its backward runs (see the module docstring)."""
        k = self.inflight(stage, num_stages)
        if not self.recompute:
            return costs.memory_sum(start, stop) + k * costs.activation_sum(start, stop)
        prefix = self._prefixes(costs)
        kept = prefix["kept_activation"].sum(start, stop)
        transient = max((costs.activation[i] for i in self.recompute if start <= i < stop), default=0.0)
        return costs.memory_sum(start, stop) + k * kept + transient

    def memory_fn(self, costs: LayerCosts, stage: int, num_stages: int) -> Callable[[int, int], float]:
        """``f(start, stop)`` == ``segment_memory(costs, start, stop, stage, num_stages)``, bit for
        bit, without the per-call overhead (balancers evaluate it thousands of times)."""
        if self.recompute:
            return lambda i, j: self.segment_memory(costs, i, j, stage, num_stages)
        k = self.inflight(stage, num_stages)
        mp, ap = costs._memory_prefix, costs._activation_prefix
        pm, dm, pa, da = mp.p, mp.den, ap.p, ap.den
        return lambda i, j: (pm[j] - pm[i]) / dm + k * ((pa[j] - pa[i]) / da)

    # ---- activation checkpointing -----------------------------------------------------------
    def with_recompute(self, layers: Iterable[int]) -> "CostModel":
        """This model with ``layers`` (indices) under activation checkpointing."""
        return replace(self, recompute=frozenset(layers))

    def _prefixes(self, costs: LayerCosts) -> _RecomputePrefix:
        """Exact prefix sums of fwd + bwd + recomputed fwd and of the activations kept in flight,
        cached for the last ``costs`` instance (LayerCosts is immutable)."""
        cached = self._recompute_prefix.get(id(costs))
        if cached is None or cached["costs"] is not costs:
            bad = [i for i in self.recompute if i >= costs.num_layers]
            if bad:
                raise ValueError(f"recompute names layers {sorted(bad)} but costs have {costs.num_layers} layers")
            rc = self.recompute
            extra = tuple(f if i in rc else 0.0 for i, f in enumerate(costs.forward))
            kept = tuple(0.0 if i in rc else a for i, a in enumerate(costs.activation))
            cached = {"costs": costs, "time": _ExactPrefix(costs.forward, costs.backward, extra),
                      "kept_activation": _ExactPrefix(kept)}
            self._recompute_prefix.clear()
            self._recompute_prefix[id(costs)] = cached
        return cached

    def stage_memory(self, costs: LayerCosts, partition: Partition) -> list[float]:
        costs._check(partition)
        b, S = partition.boundaries, partition.num_stages
        return [self.segment_memory(costs, b[s], b[s + 1], s, S) for s in range(S)]

    def fits(self, memory: float) -> bool:
        return self.capacity is None or memory <= self.capacity

    # ---- time ---------------------------------------------------------------------------
    @property
    def per_boundary(self) -> bool:
        """True when ``bandwidth`` is one value per stage boundary."""
        return isinstance(self.bandwidth, tuple)

    def check_stages(self, num_stages: int) -> None:
        """Raise a ValueError when a per-boundary ``bandwidth`` or the ``speed`` factors do not fit
        ``num_stages``."""
        bw = self.bandwidth
        if isinstance(bw, tuple) and len(bw) != num_stages - 1:  # self.per_boundary, narrowed
            raise ValueError(
                f"bandwidth has {len(bw)} per-boundary values but a pipeline of {num_stages} stages has "
                f"{num_stages - 1} boundaries; pass one value per boundary between stages s and s+1 (or one float)"
            )
        if self.speed is not None and len(self.speed) != num_stages:
            raise ValueError(f"speed has {len(self.speed)} factors but the pipeline has {num_stages} stages; pass one "
                             "per stage (PipelineLayout.stage_speed maps per-rank speeds to stages) or None")

    def stage_speed(self, stage: int | None) -> float:
        """Speed factor of ``stage`` (1.0 without ``speed``); ``stage`` may be None only then."""
        if self.speed is None:
            return 1.0
        if stage is None:
            raise ValueError("this CostModel has a speed per stage: pass the stage")
        if not 0 <= stage < len(self.speed):
            raise ValueError(f"stage {stage} outside the {len(self.speed)} stages of speed")
        return self.speed[stage]

    def link_bandwidth(self, stage: int | None) -> float | None:
        """Bytes/s of the link stage ``stage`` receives its input on (None: free; stage 0 receives
        on no boundary). ``stage`` may be None only with a single ``bandwidth``."""
        bw = self.bandwidth
        if not isinstance(bw, tuple):
            return bw
        if stage is None:
            raise ValueError("this CostModel has a bandwidth per stage boundary: pass the receiving stage")
        if not 0 <= stage <= len(bw):
            raise ValueError(f"stage {stage} receives on none of the {len(bw)} boundaries in bandwidth")
        return bw[stage - 1] if stage else None  # the first stage receives on no link

    def recv_time(self, costs: LayerCosts, start: int, stage: int | None = None) -> float:
        """Per-micro-batch link time of stage ``stage`` starting at layer ``start`` (fwd act + bwd
        grad), over the link it receives on."""
        bw = None if start == 0 else self.link_bandwidth(stage)
        return 0.0 if bw is None else 2.0 * costs.activation[start - 1] / bw

    def segment_work(self, costs: LayerCosts, start: int, stop: int) -> float:
        """Per-micro-batch compute of layers ``start..stop-1`` at speed 1.0 (no receive); a
        recomputed layer adds its forward once more."""
        return self._prefixes(costs)["time"].sum(start, stop) if self.recompute else costs.time_sum(start, stop)

    def segment_time(self, costs: LayerCosts, start: int, stop: int, stage: int | None = None) -> float:
        """Per-micro-batch time of stage ``stage`` owning layers ``start..stop-1`` (compute at the
        stage's speed + receive)."""
        compute = self.segment_work(costs, start, stop)
        if self.speed is not None:
            compute = compute / self.stage_speed(stage)
        return compute + self.recv_time(costs, start, stage)

    def stage_times(self, costs: LayerCosts, partition: Partition) -> list[float]:
        costs._check(partition)
        self.check_stages(partition.num_stages)
        b = partition.boundaries
        return [self.segment_time(costs, b[s], b[s + 1], s) for s in range(partition.num_stages)]

    def predicted_step_time(self, costs: LayerCosts, partition: Partition) -> float:
        """Fill-drain bound sum_s t_s + (m - 1) max_s t_s, used for every schedule.

        Exact for GPipe/1F1B with uniform per-micro-batch stage times; an upper bound for
        interleaved / zero-bubble schedules (they shrink the bubble). Balancers only need the
        ordering, which is dominated by the max term.
        """
        t = self.stage_times(costs, partition)
        return math.fsum(t) + (self.microbatches - 1) * max(t)

    def bubble_fraction(self, costs: LayerCosts, partition: Partition) -> float:
        """Idle share of the S x step device-time: 1 - sum_s(m t_s) / (S step)."""
        step = self.predicted_step_time(costs, partition)
        if step == 0:
            return 0.0
        busy = self.microbatches * math.fsum(self.stage_times(costs, partition))
        return 1.0 - busy / (partition.num_stages * step)

    def ideal_step_time(self, costs: LayerCosts, num_stages: int) -> float:
        """Step time of a perfect continuous split (no transfers; each stage's share of the work in
        proportion to its speed, so every stage takes total / sum(speed)): (m + S - 1) * that.
        Denominator for efficiency ratios."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        if self.speed is not None:
            self.check_stages(num_stages)
        rate = num_stages if self.speed is None else math.fsum(self.speed)
        per_stage = costs.time_sum(0, costs.num_layers) / rate
        return (self.microbatches + num_stages - 1) * per_stage

    imbalance = staticmethod(imbalance)


def choose_recompute(costs: LayerCosts, model: CostModel, partition: Partition,
                     stages: Iterable[int] | None = None) -> frozenset[int]:
    """Layers to run under activation checkpointing so that each of ``stages`` (default: all)
    fits ``model.capacity``; layers already in ``model.recompute`` stay recomputed.

    Per stage over capacity, layers are added greedily in order of activation bytes freed per
    second of extra forward (most first; ties: the higher index, whose activations live longest)
    until the stage fits. A stage that fits recomputes nothing more; a stage that cannot fit even
    fully recomputed gets every layer with activations (the caller can check
    ``model.with_recompute(result).fits(...)``). Pure and deterministic.
    """
    costs._check(partition)
    chosen = set(model.recompute)
    if model.capacity is None:
        return frozenset(chosen)
    S = partition.num_stages

    def rank(i: int) -> tuple[float, int]:
        f = costs.forward[i]
        return (-(costs.activation[i] / f) if f > 0 else -math.inf, -i)

    for s in range(S) if stages is None else stages:
        rng = partition.layers_of(s)
        current = model.with_recompute(chosen)
        for i in sorted((i for i in rng if i not in chosen and costs.activation[i] > 0), key=rank):
            if current.fits(current.segment_memory(costs, rng.start, rng.stop, s, S)):
                break
            chosen.add(i)
            current = model.with_recompute(chosen)
    return frozenset(chosen)
