// Baseline (SSE2 on x86-64) build of the CPU kernels: always available.
#include "cpu_dispatch.h"  // (its <string> before the target pragma)
#include "isa_default.h"
#include "cpu_kernels_table.h"
