#!/usr/bin/env bash
# One command for a GPU machine (one H100/H200, ~6 minutes): every check the CPU suite cannot make.
#
#   bash scripts/gpu_check.sh            # last line: one JSON object; exit 0 when every step passed
#   GPU_CHECK_OUT=dir bash scripts/gpu_check.sh   # keep the logs and the measured profile in dir
#
# Steps (each under its own time limit, so one slow step cannot eat the others' time):
#   build      the sparse extension with its CUDA kernels (FORCE_CUDA=1, strict: a failed
#              kernel build fails the step instead of falling back to the reference path)
#   cuda_tests pytest -m cuda over tests/unit (sparse kernels, FlexAttention route of hash-sparse
#              attention forward + backward against the dense reference, > 2M tokens, fp16/bf16)
#   sanitize   compute-sanitizer memcheck on the sparse CUDA tests (SANITIZER_TOOLS="memcheck
#              racecheck initcheck" for all three; the >2M-token and graph tests are left out
#              by cpp/sanitize_cuda.sh itself)
#   train      scripts/gpu_train_check.py: a GPT-2-small training run in bf16, eager and
#              torch.compile'd, same seed and batches: step times, compile speedup, loss agreement
#   profile    benchmarks/block_profile.py --device cuda: the per-layer cost profile the simulator
#              is built from, on this GPU
# Without a GPU it prints {"gpu": false, ...} and exits 0: nothing here can run on a CPU.
# The machine needs torch (CUDA build), nvcc, lightning, pytest, hypothesis, hydra-core and omegaconf.
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

step() {  # step NAME LIMIT_S CMD...: run CMD with a time limit, log to $out/NAME.log, record rc + seconds
  local name="$1" limit="$2"; shift 2
  local t0; t0=$(date +%s%N)
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local dt_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  tail -n 3 "$out/$name.log"
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $dt_ms.0e-3}" >> "$results"
}

arch="${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}"
rm -f lightning_dynmo/sparse/_C*.so
step build 150 env FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" LDSPARSE_STRICT_BUILD=1 \
  "$PY" setup.py -q build_ext --inplace
step kernels 20 "$PY" -c "from lightning_dynmo.sparse._ops import cuda_kernels_available as a; assert a(), 'no CUDA kernels'; print('CUDA kernels built')"
step cuda_tests 100 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/unit
step sanitize 90 env SANITIZER_TOOLS="${SANITIZER_TOOLS:-memcheck}" bash cpp/sanitize_cuda.sh
step train 110 "$PY" scripts/gpu_train_check.py
step profile 60 "$PY" benchmarks/block_profile.py --device cuda --out "$out/profile.json"

"$PY" - "$out" <<'EOF'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
steps = [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines()]
res = {"gpu": None, "ok": all(s["rc"] == 0 for s in steps), "out": str(out),
       "steps": {s["step"]: {"rc": s["rc"], "seconds": round(float(s["seconds"]), 1)} for s in steps}}
def last_json(name):
    try:
        return json.loads((out / f"{name}.log").read_text().strip().splitlines()[-1])
    except Exception:
        return None
tests = (out / "cuda_tests.log").read_text() if (out / "cuda_tests.log").exists() else ""
m = [l for l in tests.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
res["cuda_tests"] = m[-1].strip("= ") if m else None
san = (out / "sanitize.log").read_text() if (out / "sanitize.log").exists() else ""
res["sanitize"] = [l for l in san.splitlines() if l.startswith("OK:") or "ERROR SUMMARY" in l][-4:]
train = last_json("train")
if train:
    res["gpu"] = train.get("gpu")
    res["train"] = train
prof = last_json("profile")
if prof:
    res["profile"] = {k: prof.get(k) for k in ("device", "torch", "matmul_8192_tflops", "seconds")}
    blk, head = prof.get("block", {}), prof.get("head_loss", {})
    if blk.get("forward_ms"):
        res["profile"]["block_ms"] = {"forward": blk["forward_ms"][0], "backward": blk["backward_ms"][0]}
    res["profile"]["head_loss_ms"] = {"forward": head.get("forward_ms"), "backward": head.get("backward_ms")}
print(json.dumps(res))
sys.exit(0 if res["ok"] else 1)
EOF
