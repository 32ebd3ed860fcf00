// Instruction-set settings of the avx512 kernel builds (cpu_kernels_avx512.cpp,
// attention_kernels_avx512.cpp): AVX-512, selected at run time (no -march=native needed).
// Include after every header with inline or template code the kernels use: the target pragma
// applies to the rest of the translation unit, and a shared (COMDAT) function must never be
// compiled for a wider ISA.  Vectors are the ISA's native width (cpu_kernels.h says why).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512")
#endif
#define LDSPARSE_ISA isa_avx512
#define LDSPARSE_VBYTES 64   // native vector bytes
#define LDSPARSE_VREGS 32    // vector registers
