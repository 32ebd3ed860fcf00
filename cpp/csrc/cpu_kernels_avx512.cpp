// AVX-512 build of the CPU kernels, selected at run time (no -march=native needed).
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")
#endif
#define LDSPARSE_ISA isa_avx512
#define LDSPARSE_VBYTES 64
#define LDSPARSE_VREGS 32
#include "cpu_kernels_table.h"
