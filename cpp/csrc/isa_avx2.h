// Instruction-set settings of the avx2 kernel builds (cpu_kernels_avx2.cpp,
// attention_kernels_avx2.cpp): AVX2+FMA, selected at run time (no -march=native needed).
// Include after every header with inline or template code the kernels use: the target pragma
// applies to the rest of the translation unit, and a shared (COMDAT) function must never be
// compiled for a wider ISA.  Vectors are the ISA's native width (cpu_kernels.h says why).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#define LDSPARSE_ISA isa_avx2
#define LDSPARSE_VBYTES 32   // native vector bytes
#define LDSPARSE_VREGS 16    // vector registers
