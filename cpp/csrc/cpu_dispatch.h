// Run-time instruction-set dispatch for the CPU kernels (one table per ISA build).
#pragma once
#include <cstdint>
#include <string>

namespace ldsparse {

// Token-tile widths the kernels are instantiated for; index into the tables below.
constexpr int kTileWidths[] = {16, 32, 64, 128};
constexpr int kNumTileWidths = 4;

template <typename T>
struct CpuKernels {
  using Spmm = void (*)(const int32_t*, const int32_t*, const T*, int64_t, int64_t,
                        const T*, const T*, T*, int64_t, int64_t);
  using Sddmm = void (*)(const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                         const T*, const T*, T*);
  using Pack = void (*)(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, T*);
  Spmm spmm[kNumTileWidths];
  Sddmm sddmm[kNumTileWidths];
  Pack pack[kNumTileWidths];
  // Widest tile (index) whose SDDMM keeps g's row in vector registers; wider ones read it
  // from L1 with every FMA, two loads per FMA (AVX2 fp32: 32 tokens).
  int sddmm_widest_in_registers;
};

#define LDSPARSE_DECLARE_ISA(isa)              \
  namespace isa {                              \
  const CpuKernels<float>& kernels_f32();      \
  const CpuKernels<double>& kernels_f64();     \
  }
LDSPARSE_DECLARE_ISA(isa_default)
LDSPARSE_DECLARE_ISA(isa_avx2)
LDSPARSE_DECLARE_ISA(isa_avx512)
#undef LDSPARSE_DECLARE_ISA

// ISA the kernels dispatch to: the widest this CPU supports ("avx512", "avx2", "default"),
// unless narrowed by the LDSPARSE_ISA env var or set_cpu_isa().
const char* selected_isa();
bool set_cpu_isa(const std::string& name);
const CpuKernels<float>& cpu_kernels(float);
const CpuKernels<double>& cpu_kernels(double);

}  // namespace ldsparse
