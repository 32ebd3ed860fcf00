// Baseline (SSE2 on x86-64) build of the attention kernels: always available.
#include "isa_default.h"
#include "attention_kernels.h"
