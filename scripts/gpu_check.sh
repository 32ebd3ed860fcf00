#!/usr/bin/env bash
# One command for a GPU machine (one H100/H200, <= 8 minutes): every check the CPU suite cannot make.
#
#   bash scripts/gpu_check.sh            # last line: one JSON object; exit 0 when every step passed
#   GPU_CHECK_OUT=dir bash scripts/gpu_check.sh        # keep logs, figures and the profile in dir
#   GPU_CHECK_STEPS="build kernels spmm" bash scripts/gpu_check.sh   # a subset (run in the order below)
#
# Steps (each under its own time limit, 3x its last measured time from scripts/gpu_check_budget.json,
# so one slow step cannot eat the others' time):
#   build      the sparse extension with its CUDA kernels (FORCE_CUDA=1, strict: a failed kernel build
#              fails the step instead of falling back); the log ends with ninja's per-file times
#   kernels    the CUDA module imports and registers its ops
#   cuda_tests pytest -m cuda over tests/unit (sparse kernels, 2:4, FlexAttention route, > 2M tokens)
#   spmm       benchmarks/sparse_linear.py --device cuda --figure: the seed's SpMM figure (ours vs
#              cuSPARSE vs cuBLAS, fp32, every LDSPARSE_SPMM_KERNEL) and SparseLinear fwd+bwd vs nn.Linear
#   semi       benchmarks/semi_structured.py: 2:4 sparsity (bf16, tensor cores) vs dense
#   attention  benchmarks/sparse_attention.py --device cuda --quick: block-sparse attention vs SDPA
#   train      scripts/gpu_train_check.py: GPT-2-small in bf16, eager and torch.compile'd
#   dcp        scripts/gpu_dcp_check.py: checkpoint_format="dcp" with CUDA tensors over NCCL (resume exact)
#   profile    benchmarks/block_profile.py --device cuda: the per-layer cost profile on this GPU
#   sanitize   compute-sanitizer memcheck on the sparse CUDA tests (SANITIZER_TOOLS for more tools)
#   ncu        (not in the default steps) Nsight Compute on the default SpMM kernel at 90 % and 99 %
#              sparsity: speed of light, memory and warp-stall sections (what bounds the kernel)
# GPU_CHECK_DEADLINE=<epoch seconds> fits the run into a hard wall-clock limit (steps cut or skipped);
# CUDA_TESTS_K (a pytest -k expression) narrows the CUDA tests; SPMM_KERNELS (default "v5": the fp32
# default beside v1, the bf16 one; "v2 v3 v4 v5" times them all) picks the figure's kernels.
# Without a GPU it prints {"gpu": false, ...} and exits 0: nothing here can run on a CPU.
# The machine needs torch (CUDA build), nvcc, ninja, lightning, pytest, hypothesis, hydra-core,
# omegaconf and matplotlib.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo '{"gpu": false, "skipped": "no CUDA GPU (or no torch): run this on a GPU machine", "ok": true}'
  exit 0
fi
out="${GPU_CHECK_OUT:-$(mktemp -d)}"; mkdir -p "$out"
results="$out/steps.jsonl"; : > "$results"
STEPS="${GPU_CHECK_STEPS:-build kernels cuda_tests sanitize train profile spmm semi attention dcp}"

limit_of() {  # 3x the step's last measured seconds, at least 30
  "$PY" -c "import json,sys; b=json.load(open('scripts/gpu_check_budget.json')); print(max(30, int(3*b.get(sys.argv[1], 60))))" "$1"
}

# GPU_CHECK_DEADLINE (epoch seconds, optional): a device call has a hard wall-clock limit; steps
# are cut to the time left and skipped (rc 125, named in the log) when under 20 s remain, so the
# summary line is always printed and says which steps did not run.
DEADLINE="${GPU_CHECK_DEADLINE:-}"

step() {  # step NAME CMD...: run CMD under NAME's limit, log to $out/NAME.log, record rc + seconds
  local name="$1"; shift
  [[ " $STEPS " == *" $name "* ]] || return 0
  local limit; limit=$(limit_of "$name")
  if [[ -n "$DEADLINE" ]]; then
    local left=$(( DEADLINE - $(date +%s) ))
    if (( left < 20 )); then
      echo "== $name: skipped, ${left}s left before GPU_CHECK_DEADLINE" | tee "$out/$name.log"
      echo "{\"step\": \"$name\", \"rc\": 125, \"seconds\": 0.0, \"limit\": 0}" >> "$results"
      return 0
    fi
    (( left < limit )) && limit=$left
  fi
  local t0; t0=$(date +%s%N)
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local dt_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  [[ $rc == 124 ]] && echo "   $name: stopped at its limit (${limit}s = 3x its measured time)" | tee -a "$out/$name.log"
  tail -n 3 "$out/$name.log"
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $dt_ms.0e-3, \"limit\": $limit}" >> "$results"
}

ninja_times() {  # per-file compile seconds of the last build, slowest first
  local log; log=$(ls -t build/temp*/.ninja_log 2>/dev/null | head -1)
  [[ -n "$log" ]] || { echo "(no ninja log)"; return; }
  echo "== per-file build seconds ($log)"
  awk -F'\t' 'NR > 1 { printf "%8.1f  %s\n", ($2 - $1) / 1000, $4 }' "$log" | sort -rn
}

arch="${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}"
build() {
  rm -f lightning_dynmo/sparse/_C*.so
  env FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" LDSPARSE_STRICT_BUILD=1 \
    "$PY" setup.py -q build_ext --inplace
  local rc=$?
  ninja_times
  return $rc
}
export -f build ninja_times; export PY arch
step build bash -c build
step kernels "$PY" -c "from lightning_dynmo.sparse._ops import cuda_kernels_available as a, cuda_kernels_missing_reason as r; assert a(), r(); print('CUDA kernels built')"
step cuda_tests "$PY" -m pytest -q -p no:cacheprovider -m cuda ${CUDA_TESTS_K:+-k "$CUDA_TESTS_K"} tests/unit
# The figures first, the slowest check (the sanitizer) last: a run cut by its deadline loses least.
step spmm "$PY" benchmarks/sparse_linear.py --device cuda --quick --figure --out-dir "$out" --kernels ${SPMM_KERNELS:-v5}
step semi "$PY" benchmarks/semi_structured.py --rounds 20
step attention "$PY" benchmarks/sparse_attention.py --device cuda --quick
step train "$PY" scripts/gpu_train_check.py
step dcp "$PY" scripts/gpu_dcp_check.py
step profile "$PY" benchmarks/block_profile.py --device cuda --out "$out/profile.json"
step sanitize env SANITIZER_TOOLS="${SANITIZER_TOOLS:-memcheck}" bash cpp/sanitize_cuda.sh
ncu_spmm() {  # needs ncu and GPU performance-counter access (containers may deny it: ERR_NVGPUCTRPERM)
  local NCU; NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  [[ -x "$NCU" ]] || { echo "ncu not found"; return 2; }
  for s in 0.9 0.99; do
    echo "== ncu, sparsity $s"
    "$NCU" --kernel-name regex:spmm_stream_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      "$PY" benchmarks/spmm_ncu_target.py --sparsity "$s" || return 1
  done
}
export -f ncu_spmm
step ncu bash -c ncu_spmm

"$PY" - "$out" <<'PYEOF'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
steps = [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines()]
res = {"gpu": None, "ok": all(s["rc"] == 0 for s in steps), "out": str(out),
       "steps": {s["step"]: {"rc": s["rc"], "seconds": round(float(s["seconds"]), 1), "limit": s["limit"]}
                 for s in steps}}
def log(name):
    p = out / f"{name}.log"
    return p.read_text() if p.exists() else ""
def last_json(name):
    for line in reversed(log(name).strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None
build = log("build")
res["build_seconds_by_file"] = {m.group(2).split("/")[-1]: float(m.group(1))
                                for m in re.finditer(r"^\s+([\d.]+)  (\S+)$", build, re.M)}
m = [l for l in log("cuda_tests").splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
res["cuda_tests"] = m[-1].strip("= ") if m else None
res["sanitize"] = [l for l in log("sanitize").splitlines() if l.startswith("OK:") or "ERROR SUMMARY" in l][-4:]
train = last_json("train")
if train:
    res["gpu"] = train.get("gpu")
    res["train"] = train
prof = last_json("profile")
if prof:
    res["profile"] = {k: prof.get(k) for k in ("device", "torch", "matmul_8192_tflops", "seconds")}
spmm = last_json("spmm")
if spmm:
    res["gpu"] = res["gpu"] or spmm.get("device")
    res["spmm"] = {k: v for k, v in spmm.items() if k not in ("figure", "layers")}
for name in ("semi", "attention", "dcp"):
    j = last_json(name)
    if j:
        res[name] = {k: v for k, v in j.items() if not isinstance(v, list)}
print(json.dumps(res))
sys.exit(0 if res["ok"] else 1)
PYEOF
