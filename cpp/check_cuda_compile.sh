#!/usr/bin/env bash
# Compile-check the CUDA sources with nvcc so they cannot rot on CPU-only CI.
#
#   cpp/check_cuda_compile.sh             # torch-free kernels (csrc/cuda/sparse_kernels.cuh,
#                                         # attention_kernels.cuh), ~1 min
#   cpp/check_cuda_compile.sh --binding   # also the torch binding against the installed torch's
#                                         # headers (works with a CPU torch via a one-line shim), ~40 s
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

"$NVCC" -c -std=c++17 -O3 -Werror all-warnings "${gencode[@]}" \
  "$here/csrc/cuda/compile_check.cu" -o "$out/kernels.o"
"$NVCC" -c -std=c++17 -O3 -Werror all-warnings "${gencode[@]}" \
  "$here/csrc/cuda/attention_compile_check.cu" -o "$out/attention_kernels.o"
echo "OK: CUDA kernels compile (${archs})"

if [[ "${1:-}" == "--binding" ]]; then
  read -r torch_inc py_inc < <(python -c "import sysconfig, torch.utils.cpp_extension as c; print(c.include_paths()[0], sysconfig.get_paths()['include'])")
  # A CPU torch ships the c10/cuda headers but not this CMake-generated one.
  mkdir -p "$out/shim/c10/cuda/impl"; echo '#pragma once' > "$out/shim/c10/cuda/impl/cuda_cmake_macros.h"
  "$NVCC" -c -std=c++20 -O3 --expt-relaxed-constexpr "${gencode[@]}" -I"$torch_inc" \
    -I"$torch_inc/torch/csrc/api/include" -I"$out/shim" -I"$py_inc" -I"$here/csrc" \
    -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -diag-suppress 20012,20014,3012 \
    "$here/csrc/cuda/sparse_cuda.cu" -o "$out/binding.o"
  "$NVCC" -c -std=c++20 -O3 --expt-relaxed-constexpr "${gencode[@]}" -I"$torch_inc" \
    -I"$torch_inc/torch/csrc/api/include" -I"$out/shim" -I"$py_inc" -I"$here/csrc" \
    -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -diag-suppress 20012,20014,3012 \
    "$here/csrc/cuda/attention_cuda.cu" -o "$out/attention_binding.o"
  echo "OK: CUDA torch binding compiles"
fi
