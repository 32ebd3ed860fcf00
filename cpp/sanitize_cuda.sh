#!/usr/bin/env bash
# Run the sparse CUDA tests under compute-sanitizer on a GPU machine: memcheck (out-of-bounds
# and misaligned accesses), racecheck (shared-memory hazards), initcheck (reads of memory no one
# wrote, e.g. an output row a kernel skipped).  Exits non-zero on the first tool reporting an error.
#
#   bash cpp/sanitize_cuda.sh                       # the sparse CUDA tests
#   bash cpp/sanitize_cuda.sh tests/unit/test_sparse.py   # other test files ("-m cuda" is kept)
#
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own cudaMalloc, so an access past a
# tensor's end is caught instead of landing in the caching allocator's pool.  The >2M-token and
# CUDA-graph tests are left out (minutes under the sanitizer; graphs are checked unsanitized).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SAN="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
[[ -x "$SAN" ]] || { echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; }
targets=("${@:-tests/unit/test_sparse_cuda.py}")
read -r -a tools <<< "${SANITIZER_TOOLS:-memcheck racecheck initcheck}"  # override to run fewer
for tool in "${tools[@]}"; do
  echo "== compute-sanitizer --tool $tool"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool "$tool" --error-exitcode 1 --target-processes all \
    python -m pytest -q -x -p no:cacheprovider -m cuda -k "not grid_y and not graph" "${targets[@]}"
done
echo "OK: ${tools[*]} report no errors"
