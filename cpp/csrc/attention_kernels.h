// Per-thread CPU kernels for block-sparse causal attention (FlashAttention-2 formulation).
//
// Torch-free and OpenMP-free like cpu_kernels.h, whose vector helpers this reuses: the header
// is compiled once per instruction set (attention_kernels_{default,avx2,avx512}.cpp) and the
// driver (attention_cpu.cpp) picks the widest at run time.
//
// Forward, one work item = one query block of BS rows (FA-2's outer loop over queries):
//   for each key block kb of the row:  S = Qs Kt_kb        (Qs = Q * scale, register-tiled GEMM)
//                                      mask (diagonal block: key > query; ragged last block)
//                                      m' = max(m, rowmax S);  P = exp(S - m');
//                                      l = l e^(m - m') + rowsum P;  O = O e^(m - m') + P V_kb
//   O /= l;  lse = m + log l   (saved for the backward; memory O(T) per head)
// Backward, one work item = one key block (FA-2's outer loop over keys, via the transposed
// layout), dK and dV accumulated in registers/L1 across the query blocks that see it:
//   S = Qs Kt, P = exp(S - lse), dP = dO Vt, dS = P (dP - delta), delta = rowsum(dO * O)
//   dV += P^T dO;  dK += dS^T Qs;  dQ += dS K   (dQ into the item's private buffer: no atomics;
//   the driver sums the buffers in a fixed order, so results are deterministic)
//
// Rows are slots (see attention_cpu.cpp): with a slot map, padding slots get a key bias of
// -inf (no key) and outputs / dK / dV rows go straight to their tokens.  A row that has seen
// no key yet (only padding, or an empty layout row) contributes nothing and ends with l = 0,
// output 0 and lse = -inf, which the backward reads as P = 0.
//
// All GEMMs are one micro-kernel: C[rows][cols] (+)= A B with A read as broadcast scalars
// (optionally transposed) and B / C as rows of whole native vectors.  Register blocking
// (MR rows x NC vectors of accumulators) is sized from the ISA's register file, so the
// AVX2/SSE2 builds do not spill.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "attention_dispatch.h"
#include "cpu_kernels.h"  // Vec, vec_t, kLanes, load, store, slice

#ifndef LDSPARSE_VREGS
#error "define LDSPARSE_VBYTES and LDSPARSE_VREGS (native vectors: 64 B x 32 avx512, 32 B x 16 avx2, 16 B x 16 sse2)"
#endif

namespace ldsparse {
namespace LDSPARSE_ISA {
namespace attn {

template <typename T> struct IntOf;
template <> struct IntOf<float> { using type = int32_t; };
template <> struct IntOf<double> { using type = int64_t; };
template <typename T>
using ivec_t = typename Vec<typename IntOf<T>::type, kLanes<T>>::type;

// ---------------------------------------------------------------------------- exp
// Vector exp with Cephes' range reduction x = n ln2 + r (ln2 split in two so r is exact) and
// its expf polynomial (float, ~1 ulp) / exp Pade form (double, ~1 ulp; the fp64 build is what
// gradcheck differentiates numerically, so it must be as accurate as libm).  Inputs below
// the underflow bound, -inf (masked scores) included, give exactly 0.
template <typename T>
static inline vec_t<T> vexp(vec_t<T> x) {
  using V = vec_t<T>;
  using I = ivec_t<T>;
  constexpr bool f32 = sizeof(T) == 4;
  const V lo = V{} + (f32 ? T(-87.3365447504) : T(-708.3964185322641));
  const V hi = V{} + (f32 ? T(88.0) : T(709.0));
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V fx = xc * T(1.4426950408889634) + T(0.5);
  I n = __builtin_convertvector(fx, I);  // truncates; fix up to floor for negative fx
  n += __builtin_convertvector(n, V) > fx;
  const V nf = __builtin_convertvector(n, V);
  V y;
  if constexpr (f32) {
    const V r = xc - nf * T(0.693359375) - nf * T(-2.12194440e-4);
    y = V{} + T(1.9875691500e-4);
    y = y * r + T(1.3981999507e-3);
    y = y * r + T(8.3334519073e-3);
    y = y * r + T(4.1665795894e-2);
    y = y * r + T(1.6666665459e-1);
    y = y * r + T(5.0000001201e-1);
    y = y * (r * r) + r + T(1);
  } else {
    const V r = xc - nf * T(6.93145751953125e-1) - nf * T(1.42860682030941723212e-6);
    const V rr = r * r;
    const V px = r * ((rr * T(1.26177193074810590878e-4) + T(3.02994407707441961300e-2)) * rr +
                      T(9.99999999999999999910e-1));
    const V qx = ((rr * T(3.00198505138664455042e-6) + T(2.52448340349684104192e-3)) * rr +
                  T(2.27265548208155028766e-1)) * rr + T(2.00000000000000000009e0);
    y = T(1) + T(2) * px / (qx - px);
  }
  const I bits = (n + (f32 ? 127 : 1023)) << (f32 ? 23 : 52);  // 2^n
  V scale;
  std::memcpy(&scale, &bits, sizeof(V));
  return x < lo ? V{} : y * scale;
}

// ---------------------------------------------------------------------------- reductions
template <typename T, int N>
static inline T hmax(typename Vec<T, N>::type v) {
#ifdef LDSPARSE_HAS_SHUFFLEVECTOR
  if constexpr (N > 2) {
    constexpr int H = N / 2;
    const auto seq = std::make_index_sequence<H>{};
    const auto a = slice<T, H, 0>(v, seq), b = slice<T, H, H>(v, seq);
    return hmax<T, H>(a > b ? a : b);
  } else {
    return v[0] > v[1] ? v[0] : v[1];
  }
#else
  T m = v[0];
  for (int i = 1; i < N; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

template <typename T, int N>
static inline T hsum(typename Vec<T, N>::type v) {
#ifdef LDSPARSE_HAS_SHUFFLEVECTOR
  if constexpr (N > 2) {
    constexpr int H = N / 2;
    const auto seq = std::make_index_sequence<H>{};
    return hsum<T, H>(slice<T, H, 0>(v, seq) + slice<T, H, H>(v, seq));
  } else {
    return v[0] + v[1];
  }
#else
  T s = 0;
  for (int i = 0; i < N; ++i) s += v[i];
  return s;
#endif
}

// ---------------------------------------------------------------------------- GEMM
// Rows of accumulators for NC vectors per row, within this ISA's register file (leaving room
// for the NC B vectors and a broadcast).  0 = this NC does not fit.
constexpr int kVregBudget = LDSPARSE_VREGS >= 8 ? LDSPARSE_VREGS - 2 : LDSPARSE_VREGS - 1;
constexpr int mr_for(int nc) {
  int m = 8;
  while (m > 1 && (m + 1) * nc > kVregBudget) m /= 2;
  return (m + 1) * nc <= kVregBudget ? m : 0;
}

// C[MR][NC vectors] (+)= sum_t A(r, t) B[t][:], A(r, t) = TA ? a[t * lda + r] : a[r * lda + t].
template <typename T, int MR, int NC, bool TA, bool ACC>
static inline void gemm_tile(int64_t inner, const T* __restrict__ a, int64_t lda,
                             const T* __restrict__ b, int64_t ldb, T* __restrict__ c, int64_t ldc) {
  using V = vec_t<T>;
  constexpr int L = kLanes<T>;
  V acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < NC; ++k) acc[r][k] = ACC ? load<V>(c + r * ldc + k * L) : V{};
  for (int64_t t = 0; t < inner; ++t) {
    V bv[NC];
    for (int k = 0; k < NC; ++k) bv[k] = load<V>(b + t * ldb + k * L);
    for (int r = 0; r < MR; ++r) {
      const T s = TA ? a[t * lda + r] : a[r * lda + t];
      for (int k = 0; k < NC; ++k) acc[r][k] += s * bv[k];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < NC; ++k) store(c + r * ldc + k * L, acc[r][k]);
}

// C[rows][cols] (+)= A B.  cols: a multiple of the vector width; rows: a multiple of 8.
// Column panels of 4, then 2, then 1 vectors (taller tiles for narrower panels keep >= 8
// independent FMA chains in flight); each panel streams its B strip (<= inner x 256 bytes)
// from L1 once per row tile.
template <typename T, bool TA, bool ACC>
static void gemm(int64_t rows, int64_t cols, int64_t inner, const T* a, int64_t lda, const T* b,
                 int64_t ldb, T* c, int64_t ldc) {
  constexpr int L = kLanes<T>;
  const int64_t nv = cols / L;
  int64_t v = 0;
  auto panel = [&](auto nc_tag) {
    constexpr int NC = decltype(nc_tag)::value, MR = mr_for(NC);
    for (int64_t r = 0; r < rows; r += MR)
      gemm_tile<T, MR, NC, TA, ACC>(inner, TA ? a + r : a + r * lda, lda, b + v * L, ldb,
                                    c + r * ldc + v * L, ldc);
    v += NC;
  };
  if constexpr (mr_for(4) >= 2)
    while (nv - v >= 4) panel(std::integral_constant<int, 4>{});
  if constexpr (mr_for(2) >= 2)
    while (nv - v >= 2) panel(std::integral_constant<int, 2>{});
  static_assert(mr_for(1) >= 1, "register budget too small");
  while (v < nv) panel(std::integral_constant<int, 1>{});
}

inline int64_t round8(int64_t n) { return (n + 7) & ~int64_t(7); }

template <typename T>
static inline vec_t<T> iota() {
  vec_t<T> v;
  for (int i = 0; i < kLanes<T>; ++i) v[i] = T(i);
  return v;
}

// ---------------------------------------------------------------------------- forward
template <typename T, int BS>
static void fwd_block(const AttnFwdArgs<T>& a, int64_t bh, int64_t qb, const int32_t* cols,
                      int64_t ncols, T* scratch) {
  using V = vec_t<T>;
  constexpr int L = kLanes<T>, NV = BS / L;
  static_assert(BS % L == 0, "block size must be a whole number of vectors");
  const int64_t Sn = a.g.S, Sp = a.g.Spad, D = a.g.D, Dp = a.g.Dp;
  const int64_t i0 = qb * BS, nq = std::min<int64_t>(BS, Sn - i0), rq = round8(nq);
  T* s = scratch;        // [BS][BS] scores, then probabilities
  T* o = s + BS * BS;    // [BS][Dp] unnormalised output
  T* m = o + BS * Dp;    // [BS] running row max
  T* l = m + BS;         // [BS] running row sum
  const T* qs = a.qs + (bh * Sp + i0) * Dp;
  const T* kt = a.kt + bh * Sp * D;  // key block kb's panel: kt + kb * D * BS
  const T* vp = a.vp + bh * Sp * Dp;
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < BS; ++i) m[i] = ninf, l[i] = T(0);
  std::memset(o, 0, sizeof(T) * rq * Dp);
  const V lanes = iota<T>();

  for (int64_t c = 0; c < ncols; ++c) {
    const int64_t kb = cols[c], j0 = kb * BS, nk = std::min<int64_t>(BS, Sn - j0);
    gemm<T, false, false>(rq, BS, D, qs, Dp, kt + kb * D * BS, BS, s, BS);
    const bool full = kb != qb && nk == BS;  // no causal / ragged masking needed
    const T* bias = a.kbias ? a.kbias + bh * Sp + j0 : nullptr;
    for (int64_t i = 0; i < nq; ++i) {
      T* row = s + i * BS;
      // Last visible key column: the causal diagonal or the ragged end.
      const V last = V{} + T(kb == qb ? std::min(i, nk - 1) : nk - 1);
      V x[NV];
      for (int k = 0; k < NV; ++k) {
        x[k] = load<V>(row + k * L);
        if (bias) x[k] += load<V>(bias + k * L);
        if (!full) x[k] = lanes + T(k * L) > last ? V{} + ninf : x[k];
      }
      V mx = x[0];
      for (int k = 1; k < NV; ++k) mx = x[k] > mx ? x[k] : mx;
      const T m_new = std::max(m[i], hmax<T, L>(mx));
      if (m_new == ninf) {  // no key seen yet (only padding slots so far): nothing to add
        std::memset(row, 0, sizeof(T) * BS);
        continue;
      }
      const T alpha = std::exp(m[i] - m_new);  // 0 on the first block (m = -inf)
      V sum{};
      for (int k = 0; k < NV; ++k) {
        const V p = vexp<T>(x[k] - m_new);
        store(row + k * L, p);
        sum += p;
      }
      l[i] = l[i] * alpha + hsum<T, L>(sum);
      m[i] = m_new;
      if (alpha != T(1)) {
        T* orow = o + i * Dp;
        for (int64_t d = 0; d < Dp; d += L) store(orow + d, load<V>(orow + d) * alpha);
      }
    }
    // Rows in [nq, rq) exist only in a ragged last block: their Qs rows are zero padding, so
    // their scores and outputs stay finite and are never written out.
    gemm<T, false, true>(rq, Dp, nk, s, BS, vp + j0 * Dp, Dp, o, Dp);
  }

  for (int64_t i = 0; i < nq; ++i) {
    const bool seen = l[i] > T(0);  // else an empty layout row: output 0, like SDPA
    a.lse[bh * Sn + i0 + i] = seen ? m[i] + std::log(l[i]) : ninf;
    const int64_t tok = a.g.token(bh, i0 + i);
    if (tok < 0) continue;  // padding slot
    T* dst = a.out + (bh * a.g.T + tok) * D;
    const T* src = o + i * Dp;
    const T inv = seen ? T(1) / l[i] : T(0);
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
  }
}

// ---------------------------------------------------------------------------- backward
template <typename T, int BS>
static void bwd_block(const AttnBwdArgs<T>& a, int64_t bh, int64_t kb, const int32_t* rows,
                      int64_t nrows, T* dq, T* scratch) {
  using V = vec_t<T>;
  constexpr int L = kLanes<T>, NV = BS / L;
  const int64_t Sn = a.g.S, Sp = a.g.Spad, D = a.g.D, Dp = a.g.Dp;
  const int64_t j0 = kb * BS, nk = std::min<int64_t>(BS, Sn - j0), rk = round8(nk);
  T* s = scratch;        // [BS][BS] scores, then P
  T* dp = s + BS * BS;   // [BS][BS] dP, then dS
  T* dk = dp + BS * BS;  // [BS][Dp]
  T* dv = dk + BS * Dp;  // [BS][Dp]
  const T* kt = a.kt + bh * Sp * D + kb * D * BS;  // [D][BS] panels
  const T* vt = a.vt + bh * Sp * D + kb * D * BS;
  const T* kp = a.kp + (bh * Sp + j0) * Dp;
  std::memset(dk, 0, sizeof(T) * rk * Dp);
  std::memset(dv, 0, sizeof(T) * rk * Dp);
  const V lanes = iota<T>();

  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t qb = rows[r], i0 = qb * BS, nq = std::min<int64_t>(BS, Sn - i0), rq = round8(nq);
    const T* qs = a.qs + (bh * Sp + i0) * Dp;
    const T* dO = a.dop + (bh * Sp + i0) * Dp;
    const T* lse = a.lse + bh * Sn + i0;
    const T* delta = a.delta + bh * Sn + i0;
    // Same tiles and summation order as the forward: S is bitwise the forward's S.
    gemm<T, false, false>(rq, BS, D, qs, Dp, kt, BS, s, BS);
    gemm<T, false, false>(rq, BS, D, dO, Dp, vt, BS, dp, BS);
    const bool full = kb != qb && nk == BS;
    const T* bias = a.kbias ? a.kbias + bh * Sp + j0 : nullptr;
    for (int64_t i = 0; i < nq; ++i) {
      T* srow = s + i * BS;
      T* drow = dp + i * BS;
      const V last = V{} + T(kb == qb ? std::min(i, nk - 1) : nk - 1);
      // A row that saw no key (lse = -inf: only padding slots) has P = 0.
      const T li = lse[i] == -std::numeric_limits<T>::infinity() ? std::numeric_limits<T>::infinity() : lse[i];
      const T di = delta[i];
      for (int k = 0; k < NV; ++k) {
        V x = load<V>(srow + k * L) - li;
        if (bias) x += load<V>(bias + k * L);
        V p = vexp<T>(x);
        if (!full) p = lanes + T(k * L) > last ? V{} : p;
        store(srow + k * L, p);
        store(drow + k * L, p * (load<V>(drow + k * L) - di));
      }
    }
    for (int64_t i = nq; i < rq; ++i) std::memset(dp + i * BS, 0, sizeof(T) * BS);
    gemm<T, true, true>(rk, Dp, nq, s, BS, dO, Dp, dv, Dp);                 // dV += P^T dO
    gemm<T, true, true>(rk, Dp, nq, dp, BS, qs, Dp, dk, Dp);                // dK += dS^T Qs
    gemm<T, false, true>(rq, Dp, nk, dp, BS, kp, Dp, dq + i0 * Dp, Dp);     // dQ += dS K
  }

  for (int64_t j = 0; j < nk; ++j) {
    const int64_t tok = a.g.token(bh, j0 + j);
    if (tok < 0) continue;
    T* dkr = a.dk + (bh * a.g.T + tok) * D;
    T* dvr = a.dv + (bh * a.g.T + tok) * D;
    for (int64_t d = 0; d < D; ++d) dkr[d] = dk[j * Dp + d], dvr[d] = dv[j * Dp + d];
  }
}

}  // namespace attn

template <typename T>
static AttnKernels<T> make_attn_table() {
  return AttnKernels<T>{
      {attn::fwd_block<T, 16>, attn::fwd_block<T, 32>, attn::fwd_block<T, 64>, attn::fwd_block<T, 128>},
      {attn::bwd_block<T, 16>, attn::bwd_block<T, 32>, attn::bwd_block<T, 64>, attn::bwd_block<T, 128>}};
}

const AttnKernels<float>& attn_kernels_f32() {
  static const AttnKernels<float> table = make_attn_table<float>();
  return table;
}
const AttnKernels<double>& attn_kernels_f64() {
  static const AttnKernels<double> table = make_attn_table<double>();
  return table;
}

}  // namespace LDSPARSE_ISA
}  // namespace ldsparse
