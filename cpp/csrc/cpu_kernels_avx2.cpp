// AVX2+FMA build of the CPU kernels, selected at run time (no -march=native needed).
#include <cstdint>
#include <cstring>
#include <utility>
#include "cpu_dispatch.h"  // (its <string> before the target pragma)
#include "isa_avx2.h"
#include "cpu_kernels_table.h"
