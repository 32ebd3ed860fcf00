#!/usr/bin/env bash
# One device call as a session makes it (the device tool's $OUT comes back): install carried pure-Python
# wheels (.whl/: hydra-core, omegaconf, antlr4 -- absent from the GPU image), run gpu_check.sh with
# the steps named in $1, and, beside it on the idle CPU cores, the 8-stage CPU benchmark; pack logs.
#   bash scripts/gpu_session.sh "build kernels cuda_tests spmm attention" [at_scale_cases]
# GPU_SESSION_SECONDS (default 540): the call's wall-clock budget; gpu_check.sh gets a deadline
# 20 s short of it so the logs are always packed before the device call's own limit.
# Make the wheels once on the machine that calls the device (pure Python, any platform), keep them
# out of git (`echo /.whl/ >> .git/info/exclude`) and carry `.whl` into the call:
#   python3 -m pip wheel --no-deps -w .whl hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
export GPU_CHECK_DEADLINE=$(( $(date +%s) + ${GPU_SESSION_SECONDS:-540} - 20 ))
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "host: $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(python3 -c 'import torch; print(torch.__version__)')"
steps="${1:-build kernels cuda_tests spmm attention}"
cases="${2:-}"
g=/tmp/gc; rm -rf "$g"; mkdir -p "$g"
first="${steps%% *}"; rest="${steps#* }"
if [[ "$first" == build ]]; then GPU_CHECK_OUT="$g/b" GPU_CHECK_STEPS="build kernels" bash scripts/gpu_check.sh | tail -1; steps="${rest/kernels/}"; fi
if [[ -n "$cases" ]]; then
  left=$(( GPU_CHECK_DEADLINE - $(date +%s) - 10 ))
  (PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "$left" python3 benchmarks/at_scale.py --stages 8 --dp 1 --quick --cases "$cases" > "$g/at_scale.log" 2>&1; echo "at_scale rc=$?" >> "$g/at_scale.log") &
fi
GPU_CHECK_OUT="$g/c" GPU_CHECK_STEPS="$steps" bash scripts/gpu_check.sh
wait
tail -n 1 "$g/at_scale.log" 2>/dev/null | cut -c1-3000
cp "$g"/c/*.png "$OUT"/ 2>/dev/null
cp lightning_dynmo/sparse/_C*.so "$OUT"/ 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$g" .
