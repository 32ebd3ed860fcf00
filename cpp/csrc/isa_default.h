// Instruction-set settings of the default kernel builds (cpu_kernels_default.cpp,
// attention_kernels_default.cpp): Baseline (SSE2 on x86-64): always available.
// Include after every header with inline or template code the kernels use: the target pragma
// applies to the rest of the translation unit, and a shared (COMDAT) function must never be
// compiled for a wider ISA.  Vectors are the ISA's native width (cpu_kernels.h says why).
#define LDSPARSE_ISA isa_default
#define LDSPARSE_VBYTES 16   // native vector bytes
#define LDSPARSE_VREGS 16    // vector registers
