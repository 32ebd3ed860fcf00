#!/usr/bin/env bash
# Block-sparse attention on one GPU in < 90 s (issue 32 item 4): the CUDA tests of the attention
# route and `benchmarks/sparse_attention.py --device cuda --quick`.
#
#   bash scripts/gpu/attention.sh        # last line: one JSON object; exit 1 when a step failed
#   GPU_CHECK_OUT=dir bash scripts/gpu/attention.sh   # keep the logs in dir
#
# ok: the tests passed, the benchmark printed its JSON and its route was not the dense masked
# reference. targets_met (reported, not part of ok): >= 2x dense SDPA forward+backward at 12.5 %
# block density, and the time falling with density. The test at the benchmark's shape runs first,
# so the benchmark reuses its compiled FlexAttention kernels from inductor's on-disk cache.
# Without a GPU it prints {"gpu": false, ...} and exits 0.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo '{"gpu": false, "skipped": "no CUDA GPU (or no torch): run this on a GPU machine", "ok": true}'
  exit 0
fi
out="${GPU_CHECK_OUT:-$(mktemp -d)}"; mkdir -p "$out"
t0=$(date +%s)

echo "== tests (limit 45 s)"  # the other flex CUDA tests (test_sparse_flex.py) run in scripts/gpu_check.sh
timeout 45 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/unit/test_sparse_attention_cache.py > "$out/tests.log" 2>&1
tests_rc=$?
tail -n 3 "$out/tests.log"
t1=$(date +%s)

echo "== benchmark (limit 40 s)"
timeout 40 "$PY" benchmarks/sparse_attention.py --device cuda --quick > "$out/bench.log" 2>&1
bench_rc=$?
tail -n 2 "$out/bench.log" | cut -c1-300
t2=$(date +%s)

"$PY" - "$out" "$tests_rc" "$bench_rc" "$((t1 - t0))" "$((t2 - t1))" <<'PYEOF'
import json, re, sys
from pathlib import Path
out, tests_rc, bench_rc, t_tests, t_bench = Path(sys.argv[1]), *map(int, sys.argv[2:])
import torch
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "out": str(out),
       "steps": {"tests": {"rc": tests_rc, "seconds": t_tests}, "bench": {"rc": bench_rc, "seconds": t_bench}}}
lines = (out / "tests.log").read_text().splitlines()
summary = [l for l in lines if re.search(r"\d+ (passed|failed|error)", l)]
res["tests"] = summary[-1].strip("= ") if summary else None
bench = None
try:
    bench = json.loads((out / "bench.log").read_text().strip().splitlines()[-1])
except Exception as exc:  # no JSON: the step failed (its log says why)
    res["bench_error"] = f"no JSON last line in {out / 'bench.log'}: {exc}"
if bench:
    keep = ("route", "auto_measured_ms", "block_density", "sdpa_ms", "noise_floor", "ours_ms", "reference_ms",
            "speedup_vs_sdpa_fwd_bwd", "reference_speedup_vs_sdpa_fwd_bwd", "time_falls_with_density",
            "target_2x_at_0.125_met", "mask_build_ms", "mask_build_share_if_uncached", "seconds")
    res["bench"] = {k: bench[k] for k in keep if k in bench}
    res["targets_met"] = bool(bench.get("target_2x_at_0.125_met") and bench.get("time_falls_with_density"))
res["ok"] = tests_rc == 0 and bench_rc == 0 and bench is not None and bench.get("route") != "reference"
print(json.dumps(res))
sys.exit(0 if res["ok"] else 1)
PYEOF
