"""The benchmarks' noise-floor estimators (``benchmarks/_harness.py``): speedups and the control's
resolution are paired within rounds, so load that drifts between rounds cancels."""
from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location(  # by path: benchmarks/ is not a package on sys.path
    "dynmo_bench_harness", Path(__file__).resolve().parents[2] / "benchmarks" / "_harness.py")
_harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_harness)
bootstrap_ratio, resolution, rotated, speedup = (_harness.bootstrap_ratio, _harness.resolution, _harness.rotated,
                                                 _harness.speedup)

rates = st.lists(st.floats(1e2, 1e4), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(rates, st.data())
def test_drift_between_rounds_cancels(base, data):
    """Every configuration of a round slowed by the same factor (another job on the host during
    that round) leaves the paired speedup and resolution unchanged."""
    n = len(base)
    drift = data.draw(st.lists(st.floats(0.3, 3.0), min_size=n, max_size=n))
    dyn = [1.05 * x for x in base]
    static = list(base)
    assert abs(speedup(dyn, [static]) - 1.05) < 1e-9
    assert abs(speedup([d * c for d, c in zip(dyn, drift)], [[s * c for s, c in zip(static, drift)]]) - 1.05) < 1e-9
    assert resolution([s * c for s, c in zip(static, drift)], [s * c for s, c in zip(static, drift)]) == 0.0


def test_ratio_of_medians_would_not_cancel_drift():
    """Why pairing: unpaired medians read a speedup that no round saw."""
    static = [100, 100, 200, 200, 200]
    dyn = [100, 100, 100, 200, 200]  # equal in every round but one config ran in a slow round more
    assert statistics.median(dyn) / statistics.median(static) == 0.5
    assert speedup(dyn, [static]) == 1.0


def test_better_baseline_is_chosen_by_median_then_paired():
    a = [100, 110, 120]
    b = [90, 95, 200]  # higher median? no: 95 < 110
    assert speedup([110, 121, 132], [a, b]) == 1.1


def test_missing_runs_are_skipped_and_empty_is_none():
    assert speedup([None, 110], [[100, 100]]) == 1.1
    assert speedup([], [[]]) is None
    assert resolution([None], [100]) is None


def test_bootstrap_interval_brackets_a_constant_ratio():
    lo, hi = bootstrap_ratio([110, 220, 330, 440], [[100, 200, 300, 400]])
    assert lo == hi == 1.1
    assert bootstrap_ratio([1, 2], [[1]]) is None  # rounds must align


@given(st.lists(st.integers(), min_size=1, max_size=7))
def test_rotation_puts_every_configuration_in_every_place(items):
    n = len(items)
    orders = [rotated(items, r) for r in range(n)]
    assert all(sorted(o) == sorted(items) for o in orders)
    for pos in range(n):
        assert sorted(o[pos] for o in orders) == sorted(items)


def test_the_no_harm_verdict_takes_the_runs_noise_floor_into_account():
    verdict = _harness.no_harm_verdict
    assert verdict(0.99, 0.01) == "met"
    assert verdict(0.975, 0.01) == "unresolved"  # below 0.98, but within this run's noise
    assert verdict(0.95, 0.01) == "missed"  # below by more than the noise: real harm
    assert verdict(1.02, 0.05) == "unresolved"  # a run this noisy cannot resolve a 2 % gap
    assert verdict(0.90, 0.05) == "missed"
    assert verdict(None, 0.01) == verdict(0.99, None) == "unresolved"
    # two rounds whose control agreed by luck: the interval says how far identical runs can land
    assert verdict(0.945, 0.012, resolution_ci=[0.80, 1.18]) == "unresolved"
    assert verdict(0.99, 0.01, resolution_ci=[0.995, 1.015]) == "met"
