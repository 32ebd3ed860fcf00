#!/usr/bin/env bash
# Compile-check the CUDA sources with nvcc so they cannot rot on CPU-only CI.
#
#   cpp/check_cuda_compile.sh             # the torch-free kernel units (csrc/cuda/*.cu), ~10 s a unit
#   cpp/check_cuda_compile.sh --binding   # also the host-compiled torch bindings (csrc/cuda/*.cpp)
#                                         # against the installed torch's headers (a CPU torch works
#                                         # via a one-line shim)
# Exits 0 with a SKIP message when nvcc is absent.  CUDA_ARCHS overrides the target list.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "SKIP: nvcc not found"; exit 0
fi
archs="${CUDA_ARCHS:-80 90}"
gencode=()
for a in $archs; do gencode+=("-gencode=arch=compute_${a},code=sm_${a}"); done
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT

pids=()
for cu in "$here"/csrc/cuda/*.cu; do
  "$NVCC" -c -std=c++17 -O3 -Werror all-warnings "${gencode[@]}" -I"$here/csrc" "$cu" \
    -o "$out/$(basename "$cu").o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "OK: CUDA kernels compile (${archs})"

if [[ "${1:-}" == "--binding" ]]; then
  cuda_inc=""
  for c in ${CUDA_HOME:-} /usr/local/cuda /usr/local/cuda-*; do
    [[ -f "$c/include/cuda_runtime.h" ]] && { cuda_inc="$c/include"; break; }
  done
  [[ -n "$cuda_inc" ]] || { echo "cuda_runtime.h not found: set CUDA_HOME"; exit 2; }
  read -r torch_inc py_inc < <(python -c "import sysconfig, torch.utils.cpp_extension as c; print(c.include_paths()[0], sysconfig.get_paths()['include'])")
  # A CPU torch ships the c10/cuda headers but not this CMake-generated one.
  mkdir -p "$out/shim/c10/cuda/impl"; echo '#pragma once' > "$out/shim/c10/cuda/impl/cuda_cmake_macros.h"
  for cpp in "$here"/csrc/cuda/*_binding.cpp; do
    g++ -c -std=c++20 -O1 -fPIC -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" -I"$out/shim" \
      -I"$py_inc" -I"$cuda_inc" -I"$here/csrc" -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C_cuda \
      "$cpp" -o "$out/$(basename "$cpp").o"
  done
  echo "OK: CUDA torch bindings compile"
fi
