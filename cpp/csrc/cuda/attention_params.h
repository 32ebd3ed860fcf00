// Parameter structs of the block-sparse attention kernels (attention_kernels.cuh), shared with
// the host-compiled torch binding (attention_binding.cpp), which never includes device code.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define LDSPARSE_HD __device__ __forceinline__
#else
#define LDSPARSE_HD inline
#endif

namespace ldsparse {
namespace cuda {
namespace attn {

constexpr int kMaxHeadDim = 128;

// A [B, H, T, D] operand with arbitrary strides (elements) and contiguous rows.
template <typename T>
struct Src {
  const T* p;
  int64_t sb, sh, st;
  LDSPARSE_HD const T* row(int b, int h, int t) const {
    return p + b * sb + h * sh + static_cast<int64_t>(t) * st;
  }
};

struct Geom {
  const int32_t* slot_token;  // [BH][S] slot -> token (-1: padding), or null: identity
  int H, T, S, D, bs, nblk;
  float scale;
  // Token at slot s (-1: padding slot or past the end).
  LDSPARSE_HD int token(int bh, int s) const {
    if (s >= S) return -1;
    return slot_token ? slot_token[static_cast<int64_t>(bh) * S + s] : s;
  }
};

template <typename T>
struct FwdParams {
  Geom g;
  Src<T> q, k, v;
  const int32_t* row_ptr;  // [BH][nblk + 1]
  const int32_t* col_idx;
  T* out;                  // [BH][T][D] token order
  float* lse;              // [BH][S] slot order, natural log
};

template <typename T>
struct BwdParams {
  Geom g;
  Src<T> q, k, v, dout;
  const int32_t* col_ptr;  // transposed layout [BH][nblk + 1]
  const int32_t* row_idx;
  const float* lse;        // [BH][S]
  const float* delta;      // [BH][T] token order: rowsum(dO * O)
  T* dk;                   // [BH][T][D]
  T* dv;                   // [BH][T][D]
  float* dq_acc;           // [BH][S][D] slot order, zeroed, unscaled
};

}  // namespace attn
}  // namespace cuda
}  // namespace ldsparse
