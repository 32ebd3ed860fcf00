// AVX2+FMA build of the attention kernels, selected at run time (no -march=native needed).
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
#pragma GCC target("avx2,fma")
#endif
#define LDSPARSE_ISA isa_avx2
#define LDSPARSE_VBYTES 32
#define LDSPARSE_VREGS 16
#include "attention_kernels.h"
