// Instantiates the kernel table for the ISA namespace LDSPARSE_ISA (include once per TU).
#pragma once
#include "cpu_dispatch.h"
#include "cpu_kernels.h"

namespace ldsparse {
namespace LDSPARSE_ISA {

template <typename T>
static CpuKernels<T> make_table() {
  return CpuKernels<T>{
      {spmm_rows<T, 16>, spmm_rows<T, 32>, spmm_rows<T, 64>,
       spmm_rows<T, 128>},
      {sddmm_rows<T, 16>, sddmm_rows<T, 32>, sddmm_rows<T, 64>,
       sddmm_rows<T, 128>},
      {pack_tile<T, 16>, pack_tile<T, 32>, pack_tile<T, 64>,
       pack_tile<T, 128>},
      sddmm_g_in_registers<T, 128>()  ? 3
      : sddmm_g_in_registers<T, 64>() ? 2
      : sddmm_g_in_registers<T, 32>() ? 1
                                      : 0};
}

const CpuKernels<float>& kernels_f32() {
  static const CpuKernels<float> table = make_table<float>();
  return table;
}
const CpuKernels<double>& kernels_f64() {
  static const CpuKernels<double> table = make_table<double>();
  return table;
}

}  // namespace LDSPARSE_ISA
}  // namespace ldsparse
