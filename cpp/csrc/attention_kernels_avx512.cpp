// AVX-512 build of the attention kernels, selected at run time (no -march=native needed).
// Every header with inline or template code the kernels use comes before the target pragma,
// so no shared (COMDAT) function is ever compiled for the wider ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "attention_dispatch.h"
#include "cpu_dispatch.h"
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")
#endif
#define LDSPARSE_ISA isa_avx512
#define LDSPARSE_VBYTES 64
#define LDSPARSE_VREGS 32
#include "attention_kernels.h"
