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
#include "isa_avx512.h"
#include "attention_kernels.h"
