// Block-sparse causal attention on the CPU: the per-ISA kernel table (one build per ISA,
// picked at run time like the SpMM kernels, see cpu_dispatch.h).
//
// The kernels work on the "slot" sequence the layout is defined on (S slots; S = T unless
// the caller permutes tokens, see attention_cpu.cpp).  Operands are packed once per call by
// the driver so that every inner loop runs over whole 64-byte vectors, with no tails:
//   qs  [BH][Spad][Dp]  queries times the softmax scale, zero-padded
//   kt  [BH][nblk][D][BS] keys transposed per block: one contiguous panel per key block
//                       (a [D][Spad] layout would put the GEMM's B rows a power of two apart)
//   vp  [BH][Spad][Dp]  values, zero-padded                        (backward: also kp, dop)
// Spad = ceil(S / BS) * BS, Dp = D rounded up to whole vectors of the element type.
// Results are written straight to token order through slot_token (slot -> token, -1 = none).
#pragma once
#include <cstdint>

namespace ldsparse {

// Layout block sizes the kernels are instantiated for; index into the tables below.
constexpr int kAttnBlocks[] = {16, 32, 64, 128};
constexpr int kNumAttnBlocks = 4;

struct AttnGeom {
  int64_t S, Spad, D, Dp;
  int64_t T;                   // tokens per head of the outputs
  const int32_t* slot_token;   // [BH][S] slot -> token (-1: padding slot), or null: identity
  int64_t token(int64_t bh, int64_t s) const { return slot_token ? slot_token[bh * S + s] : s; }
};

template <typename T>
struct AttnFwdArgs {
  AttnGeom g;
  const T* qs;
  const T* kt;
  const T* vp;
  T* out;  // [BH][T][D] token order
  T* lse;  // [BH][S] slot order; -inf for rows that see no key
  const T* kbias;  // [BH][Spad] 0, or -inf at padding slots (they are no keys); null: none
};

template <typename T>
struct AttnBwdArgs {
  AttnGeom g;
  const T* qs;     // [BH][Spad][Dp], scaled as in the forward
  const T* kt;     // [BH][nblk][D][BS]
  const T* vt;     // [BH][nblk][D][BS]
  const T* kp;     // [BH][Spad][Dp]
  const T* dop;    // [BH][Spad][Dp]  incoming gradient of the output
  const T* lse;    // [BH][S]
  const T* delta;  // [BH][S]         rowsum(dO * O)
  T* dk;           // [BH][T][D] token order
  T* dv;           // [BH][T][D] token order
  const T* kbias;  // as in AttnFwdArgs
};

template <typename T>
struct AttnKernels {
  // One query block (bh, qb) over its key blocks cols[0..ncols): writes out rows and lse.
  using Fwd = void (*)(const AttnFwdArgs<T>&, int64_t bh, int64_t qb, const int32_t* cols,
                       int64_t ncols, T* scratch);
  // One key block (bh, kb) over the query blocks rows[0..nrows) that attend to it: writes dK
  // and dV rows, accumulates the unscaled dQ into dq (this item's private [Spad][Dp] buffer).
  using Bwd = void (*)(const AttnBwdArgs<T>&, int64_t bh, int64_t kb, const int32_t* rows,
                       int64_t nrows, T* dq, T* scratch);
  Fwd fwd[kNumAttnBlocks];
  Bwd bwd[kNumAttnBlocks];
};

// Scratch elements one thread needs (64-byte aligned by the caller).
inline int64_t attn_fwd_scratch(int64_t bs, int64_t dp) { return bs * bs + bs * dp + 2 * bs; }
inline int64_t attn_bwd_scratch(int64_t bs, int64_t dp) { return 2 * bs * bs + 2 * bs * dp; }

#define LDSPARSE_DECLARE_ATTN_ISA(isa)            \
  namespace isa {                                 \
  const AttnKernels<float>& attn_kernels_f32();   \
  const AttnKernels<double>& attn_kernels_f64();  \
  }
LDSPARSE_DECLARE_ATTN_ISA(isa_default)
LDSPARSE_DECLARE_ATTN_ISA(isa_avx2)
LDSPARSE_DECLARE_ATTN_ISA(isa_avx512)
#undef LDSPARSE_DECLARE_ATTN_ISA

}  // namespace ldsparse
