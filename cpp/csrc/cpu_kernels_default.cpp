// Baseline (SSE2 on x86-64) build of the CPU kernels: always available.
#define LDSPARSE_ISA isa_default
#include "cpu_kernels_table.h"
