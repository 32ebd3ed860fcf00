// Baseline (SSE2 on x86-64) build of the attention kernels: always available.
#define LDSPARSE_ISA isa_default
#define LDSPARSE_VBYTES 16
#define LDSPARSE_VREGS 16
#include "attention_kernels.h"
