"""Shared plumbing for the benchmarks: launching workers and timing steps.

Workers run in fresh processes (one thread each) so that every variant is measured under the
same conditions, one after another within one invocation; the machine is shared and noisy, so
variants are interleaved over repeats and the median is reported.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def launch(script: Path, nproc: int, args: list[str], timeout: int = 900) -> dict:
    """Run ``script --worker ...`` on ``nproc`` ranks (torchrun if > 1); return its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        if nproc == 1:
            cmd = [sys.executable, str(script), "--worker", "--out", str(out), *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--standalone",
                   str(script), "--worker", "--out", str(out), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(_failure_report(proc))
        return json.loads(out.read_text())


_CAUSE_MARKS = ("Error", "error:", "terminate called", "what():", "Traceback", "Exception", "Fatal", "Signal")


def _failure_report(proc: subprocess.CompletedProcess) -> str:
    """What a failed run says about its cause: the workers' first error lines (torchrun's own
    summary at the end only names the signal), the tails, and a file with the whole output."""
    fd, path = tempfile.mkstemp(prefix="dynmo_bench_failure_", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(proc.stdout + "\n----- stderr -----\n" + proc.stderr)
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    causes = [ln for ln in lines if any(m in ln for m in _CAUSE_MARKS) and "torch/distributed/elastic" not in ln
              and "error_file" not in ln and "ChildFailedError" not in ln][:40]
    return ("benchmark worker failed (whole output: " + path + ")\nfirst error lines:\n" + "\n".join(causes)
            + f"\n--- stdout tail ---\n{proc.stdout[-2000:]}\n--- stderr tail ---\n{proc.stderr[-3000:]}")


def write_result(path: str, result: dict) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        Path(path).write_text(json.dumps(result))


def __getattr__(name: str):
    """``StepTimer`` and ``Attribution`` (Lightning callbacks) are built on first use, so that a
    launcher, which only starts workers and summarises, does not pay for importing Lightning."""
    if name in ("StepTimer", "Attribution"):
        globals().update(_callbacks())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _callbacks() -> dict:
    import lightning as L

    class StepTimer(L.Callback):
        """Wall time of each training step, measured on every rank from batch start to batch end
        (the optimizer step included), plus the step's logged metrics."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.metrics: list[dict] = []
            self.busy: list[list[float]] = []  # per pipeline rank, seconds of compute in each step

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())
            self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
            self.busy.append(list(getattr(getattr(trainer.strategy, "pipeline", None), "rank_busy_seconds", [])))

        def seconds_per_step(self, skip: int) -> float:
            """Median step-to-step time after ``skip`` warm-up steps."""
            ts = self.starts[skip:]
            deltas = [b - a for a, b in zip(ts, ts[1:])]
            return statistics.median(deltas) if deltas else float("nan")


    class Attribution(L.Callback):
        """Per profiled step, this rank's share of busy (chunk) seconds that no layer's profiled cost
        covers, over the profile window so far (``PipelineProfiler.attribution``); :meth:`gathered`
        is the median over steps of each rank, the same list on every rank."""

        def __init__(self) -> None:
            self.fractions: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            prof = getattr(getattr(trainer.strategy, "pipeline", None), "profiler", None)
            if prof is not None and prof.layer_profiling:
                busy, attributed = prof.attribution()
                if busy > 0:
                    self.fractions.append(1.0 - attributed / busy)

        def gathered(self) -> list[float | None]:
            import torch.distributed as dist

            mine = statistics.median(self.fractions) if self.fractions else None
            if not (dist.is_available() and dist.is_initialized()):
                return [mine]
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
            return parts

    return {"StepTimer": StepTimer, "Attribution": Attribution}


def median(xs):
    return statistics.median(xs)


def round_robin(fns: dict, rounds: int) -> dict:
    """Median milliseconds of each callable, one warm-up call each, then ``rounds`` interleaved
    calls (variants side by side, so load changes on a shared machine hit all of them alike)."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


# ------------------------------------------------------------------------------ noise floor
# Runs of one round share the machine's load at that time; rounds minutes apart do not (other
# jobs on a shared host come and go). So speedups and the noise floor compare runs *within* a
# round (paired) and take the median over rounds, and intervals resample whole rounds.
def _paired(num: list, den: list) -> list[float]:
    return [a / b for a, b in zip(num, den) if a and b]


def paired_ratio(num: list[float | None], den: list[float | None], median=statistics.median) -> float | None:
    """Median over rounds of ``num[r] / den[r]`` (rounds where both ran)."""
    ratios = _paired(num, den)
    return median(ratios) if ratios else None


def best_baseline(dens: list[list[float | None]], median=statistics.median) -> int | None:
    """Index of the baseline with the highest median over rounds (the better static split)."""
    meds = [median([x for x in d if x]) if any(d) else None for d in dens]
    ok = [i for i, m in enumerate(meds) if m is not None]
    return max(ok, key=lambda i: meds[i]) if ok else None


def speedup(num: list[float | None], dens: list[list[float | None]], median=statistics.median) -> float | None:
    """Paired speedup over the better of several baselines: the baseline with the higher median,
    then the median over rounds of ``num[r] / baseline[r]``."""
    k = best_baseline(dens, median)
    return None if k is None else paired_ratio(num, dens[k], median)


def resolution(a: list[float | None], b: list[float | None], median=statistics.median) -> float | None:
    """``|1 - median_r(a[r] / b[r])|`` of one configuration measured twice per round (the
    control), the same paired estimator as every speedup: how far apart two identical runs land
    on this machine. A speedup within it is noise. ``median``: the one the benchmark's summary uses
    (e.g. ``statistics.median_low``)."""
    r = paired_ratio(a, b, median)
    return None if r is None else abs(1.0 - r)


#: Do no harm: where DynMo cannot help, it keeps at least this fraction of the better static split's throughput.
NO_HARM_TARGET = 0.98


def no_harm_verdict(speedup: float | None, resolution: float | None, target: float = NO_HARM_TARGET,
                    resolution_ci: list[float] | None = None) -> str:
    """Whether a run shows ``speedup >= target``, taking its own noise floor into account:
    ``met`` (the speedup reaches the target and the run resolves the gap), ``missed`` (below the
    target by more than the noise: real harm), or ``unresolved`` (two identical static runs land
    further apart than the gap it would need to see). The noise is the control's ``resolution``, or
    the furthest its 95 % interval ``resolution_ci`` strays from 1 where that is further (a few
    rounds can agree by luck)."""
    if speedup is None or resolution is None:
        return "unresolved"
    noise = max([resolution, *(abs(1.0 - x) for x in (resolution_ci or ()))])
    if speedup < target - noise:
        return "missed"
    if noise > 1.0 - target:
        return "unresolved"
    return "met" if speedup >= target else "unresolved"


def bootstrap_ratio(num: list[float], dens: list[list[float]], resamples: int = 2000, seed: int = 0,
                    level: float = 0.95, median=statistics.median) -> list[float] | None:
    """A percentile bootstrap interval over rounds of :func:`speedup` (the paired speedup over
    the better of several baselines, chosen again in each resample). Rounds are resampled as a
    whole, so ``num`` and every ``dens[k]`` hold one value per round, in round order. With the
    control as ``num`` and its twin as the one baseline, the interval's distance from 1 is how far
    a single speedup figure of this run can be trusted (``resolution_ci95``)."""
    import random

    n = len(num)
    if n == 0 or any(len(d) != n for d in dens) or not all(num) or not all(all(d) for d in dens):
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(speedup([num[i] for i in idx], [[d[i] for i in idx] for d in dens], median))
    ratios.sort()
    lo = ratios[int((1 - level) / 2 * resamples)]
    hi = ratios[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return [round(lo, 4), round(hi, 4)]


def rotated(items: list, round_index: int) -> list:
    """``items`` starting at position ``round_index`` (mod len): each configuration takes every
    place in a round in turn, so a position effect (the first run after a pause, the one beside a
    periodic job) hits none of them systematically."""
    k = round_index % len(items) if items else 0
    return items[k:] + items[:k]
