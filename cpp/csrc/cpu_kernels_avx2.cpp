// AVX2+FMA build of the CPU kernels, selected at run time (no -march=native needed).
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#define LDSPARSE_ISA isa_avx2
#define LDSPARSE_VBYTES 32
#define LDSPARSE_VREGS 16
#include "cpu_kernels_table.h"
