// Per-thread CPU inner kernels for CSR SpMM / SDDMM on token tiles.
//
// Torch-free and OpenMP-free on purpose: this header is compiled once per instruction set
// (cpu_kernels_{default,avx2,avx512}.cpp, each under its own `#pragma GCC target`) and the
// driver (sparse_cpu.cpp) picks the widest at run time, so no -march=native is needed.
// Vectors are GCC vector extensions of the ISA's native width (LDSPARSE_VBYTES: 16 sse2,
// 32 avx2, 64 avx512).  Never wider: GCC has no machine mode for a 64-byte vector without
// AVX-512, so it kept such vectors in memory (every broadcast 16 scalar stores, every
// accumulator spilled) and the AVX2 build ran 5-15x slower than the AVX-512 one.
//
// Layout: a token tile of TT tokens is packed feature-major, tile[f * TT + i] = feature f
// of token i.  A CSR row is then broadcast-FMA over contiguous TT lanes (SpMM) or a
// TT-long dot product (SDDMM), and the tile stays in L2 while every row reads it.
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>

#ifndef LDSPARSE_ISA
#error "define LDSPARSE_ISA (the namespace for this instruction-set build) before including"
#endif
#if !defined(LDSPARSE_VBYTES) || !defined(LDSPARSE_VREGS)
#error "define LDSPARSE_VBYTES (native vector bytes) and LDSPARSE_VREGS (vector registers)"
#endif

namespace ldsparse {
namespace LDSPARSE_ISA {

template <typename T, int N>
struct Vec {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
};
template <typename T>
constexpr int kLanes = LDSPARSE_VBYTES / static_cast<int>(sizeof(T));
// Accumulator vectors a kernel keeps in flight: enough independent FMA chains to cover the
// FMA latency (4 cycles x 2 pipes), few enough to leave registers for loads and broadcasts.
constexpr int kAccVecs = 8;
template <typename T>
using vec_t = typename Vec<T, kLanes<T>>::type;

template <typename V, typename T>
static inline V load(const T* p) { V v; std::memcpy(&v, p, sizeof(V)); return v; }
template <typename V, typename T>
static inline void store(T* p, V v) { std::memcpy(p, &v, sizeof(V)); }

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LDSPARSE_HAS_SHUFFLEVECTOR 1
#endif
#endif

#ifdef LDSPARSE_HAS_SHUFFLEVECTOR
// Lanes [Off, Off + sizeof...(I)) of v as a shorter vector.
template <typename T, int N, int Off, typename V, std::size_t... I>
static inline typename Vec<T, N>::type slice(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (Off + static_cast<int>(I))...);
}

// Four N-lane vectors -> their four horizontal sums, halving lanes until 4 remain then a
// 4x4 transpose-add: ~6 shuffles + adds per sum instead of a scalar lane-by-lane loop.
template <typename T, int N>
static inline typename Vec<T, 4>::type hsum4(typename Vec<T, N>::type a, typename Vec<T, N>::type b,
                                             typename Vec<T, N>::type c, typename Vec<T, N>::type d) {
  if constexpr (N == 2) {  // fp64 on SSE2
    return typename Vec<T, 4>::type{a[0] + a[1], b[0] + b[1], c[0] + c[1], d[0] + d[1]};
  } else if constexpr (N == 4) {
    using v4 = typename Vec<T, 4>::type;
    const v4 ab = __builtin_shufflevector(a, b, 0, 4, 1, 5) + __builtin_shufflevector(a, b, 2, 6, 3, 7);
    const v4 cd = __builtin_shufflevector(c, d, 0, 4, 1, 5) + __builtin_shufflevector(c, d, 2, 6, 3, 7);
    return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
  } else {
    constexpr int H = N / 2;
    const auto seq = std::make_index_sequence<H>{};
    return hsum4<T, H>(slice<T, H, 0>(a, seq) + slice<T, H, H>(a, seq),
                       slice<T, H, 0>(b, seq) + slice<T, H, H>(b, seq),
                       slice<T, H, 0>(c, seq) + slice<T, H, H>(c, seq),
                       slice<T, H, 0>(d, seq) + slice<T, H, H>(d, seq));
  }
}
#else
// Older compilers (GCC < 12): plain lane loop, correct but slower.
template <typename T, int N>
static inline typename Vec<T, 4>::type hsum4(typename Vec<T, N>::type a, typename Vec<T, N>::type b,
                                             typename Vec<T, N>::type c, typename Vec<T, N>::type d) {
  typename Vec<T, 4>::type r{};
  for (int i = 0; i < N; ++i) { r[0] += a[i]; r[1] += b[i]; r[2] += c[i]; r[3] += d[i]; }
  return r;
}
#endif

// Whether a tile of TT tokens moves through 8x8 register transposes: only where 8 values fit one
// native vector (fp32 on AVX2, fp32 and fp64 on AVX-512), since wider GCC vectors live in memory.
template <typename T, int TT>
constexpr bool kTranspose8 = TT % 8 == 0 && 8 * static_cast<int>(sizeof(T)) <= LDSPARSE_VBYTES;

#ifdef LDSPARSE_HAS_SHUFFLEVECTOR
// 8x8 transpose in registers: o[m][k] = a[k][m] (24 shuffles instead of 64 scalar copies).
template <typename T>
static inline void transpose8(const typename Vec<T, 8>::type (&a)[8], typename Vec<T, 8>::type (&o)[8]) {
  typename Vec<T, 8>::type b[8], c[8];
  for (int k = 0; k < 8; k += 2) {  // interleave row pairs
    b[k] = __builtin_shufflevector(a[k], a[k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    b[k + 1] = __builtin_shufflevector(a[k], a[k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int k = 0; k < 8; k += 4) {  // then pairs of pairs
    c[k] = __builtin_shufflevector(b[k], b[k + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    c[k + 1] = __builtin_shufflevector(b[k], b[k + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    c[k + 2] = __builtin_shufflevector(b[k + 1], b[k + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    c[k + 3] = __builtin_shufflevector(b[k + 1], b[k + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int k = 0; k < 4; ++k) {  // then the two halves
    o[k] = __builtin_shufflevector(c[k], c[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    o[k + 4] = __builtin_shufflevector(c[k], c[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}
#endif

// y[i * ldy + rb + r] = buf[r * TT + i] for r < nr, i < tt: a block of finished rows (lanes =
// tokens) written out token-major, each token's rows in one go.  8x8 register transposes where
// the block is whole; the scalar strided copy they replace was ~15 % of the AVX2 SpMM.
template <typename T, int TT>
static inline void store_rows_transposed(const T* buf, int64_t nr, int64_t tt, T* y, int64_t ldy,
                                         int64_t rb) {
  int64_t r8 = 0;
#ifdef LDSPARSE_HAS_SHUFFLEVECTOR
  if constexpr (kTranspose8<T, TT>) {
    using V8 = typename Vec<T, 8>::type;
    const int64_t tt8 = tt & ~int64_t(7), nr8 = nr & ~int64_t(7);
    for (int64_t i8 = 0; i8 < tt8; i8 += 8) {
      for (r8 = 0; r8 < nr8; r8 += 8) {
        V8 a[8], o[8];
        for (int k = 0; k < 8; ++k) a[k] = load<V8>(buf + (r8 + k) * TT + i8);
        transpose8<T>(a, o);
        for (int m = 0; m < 8; ++m) store(y + (i8 + m) * ldy + rb + r8, o[m]);
      }
    }
    for (int64_t i = tt8; i < tt; ++i)
      for (int64_t r = 0; r < nr8; ++r) y[i * ldy + rb + r] = buf[r * TT + i];
    r8 = nr8;
  }
#endif
  for (int64_t i = 0; i < tt; ++i) {
    T* yr = y + i * ldy + rb;
    for (int64_t r = r8; r < nr; ++r) yr[r] = buf[r * TT + i];
  }
}

// y[i * ldy + r] = bias[r] + sum_j val[j] * tile[col[j] * TT + i], rows r in [r0, r1), i < tt.
// A tile row wider than kAccVecs vectors is done in panels of kAccVecs vectors (one pass over
// the CSR row each), so the accumulators always stay in registers.
template <typename T, int TT>
static void spmm_rows(const int32_t* crow, const int32_t* col, const T* val, int64_t r0,
                      int64_t r1, const T* tile, const T* bias, T* y, int64_t ldy, int64_t tt) {
  using V = vec_t<T>;
  constexpr int L = kLanes<T>, NV = TT / L, NP = NV < kAccVecs ? NV : kAccVecs;
  constexpr int U = NP >= kAccVecs ? 1 : kAccVecs / NP, RB = 16;
  static_assert(TT % L == 0 && NV % NP == 0, "tile width must be a whole number of panels");
  alignas(64) T buf[RB * TT];  // RB finished rows, written out transposed in one go
  for (int64_t rb = r0; rb < r1; rb += RB) {
    const int64_t re = rb + RB < r1 ? rb + RB : r1;
    for (int64_t r = rb; r < re; ++r) {
      const T b = bias ? bias[r] : T(0);
      const int32_t beg = crow[r], end = crow[r + 1];
      for (int p = 0; p < NV; p += NP) {
        // U accumulator sets (>= kAccVecs vectors in flight) so consecutive non-zeros do not
        // serialise on FMA latency when the panel is only one or two vectors wide.
        V acc[U][NP];
        for (int u = 0; u < U; ++u)
          for (int k = 0; k < NP; ++k) acc[u][k] = V{} + (u == 0 ? b : T(0));
        const T* tp = tile + p * L;
        int32_t j = beg;
        for (; j + U - 1 < end; j += U) {
          for (int u = 0; u < U; ++u) {
            const T w = val[j + u];
            const T* xr = tp + static_cast<int64_t>(col[j + u]) * TT;
            for (int k = 0; k < NP; ++k) acc[u][k] += w * load<V>(xr + k * L);
          }
        }
        for (; j < end; ++j) {
          const T w = val[j];
          const T* xr = tp + static_cast<int64_t>(col[j]) * TT;
          for (int k = 0; k < NP; ++k) acc[0][k] += w * load<V>(xr + k * L);
        }
        for (int k = 0; k < NP; ++k) {
          V sum = acc[0][k];
          for (int u = 1; u < U; ++u) sum += acc[u][k];
          store(buf + (r - rb) * TT + (p + k) * L, sum);
        }
      }
    }
    store_rows_transposed<T, TT>(buf, re - rb, tt, y, ldy, rb);
  }
}

template <typename T, int TT>
constexpr bool sddmm_g_in_registers() { return TT / kLanes<T> + 12 <= LDSPARSE_VREGS; }

// out[j] += dot(gtile[(row(j) - g0) * TT : +TT], tile[col[j] * TT : +TT]) for rows [r0, r1);
// gtile holds only rows [g0, ...).  Four non-zeros at a time: independent FMA chains and
// one shared horizontal reduction.
template <typename T, int TT>
static void sddmm_rows(const int32_t* crow, const int32_t* col, int64_t r0, int64_t r1, int64_t g0,
                       const T* gtile, const T* tile, T* out) {
  using V = vec_t<T>;
  using V4 = typename Vec<T, 4>::type;
  constexpr int L = kLanes<T>, NV = TT / L;
  static_assert(TT % L == 0, "tile width must be a whole number of vectors");
  // g's row stays in registers while it leaves room for the 4 sums and their operands;
  // wider rows (fp32 tiles of 64 and 128 on AVX2) read it from L1 with every FMA instead.
  constexpr bool kGRegs = sddmm_g_in_registers<T, TT>();
  for (int64_t r = r0; r < r1; ++r) {
    V g[kGRegs ? NV : 1];
    const T* grow = gtile + (r - g0) * TT;
    if constexpr (kGRegs)
      for (int k = 0; k < NV; ++k) g[k] = load<V>(grow + k * L);
    auto gv = [&](int k) { if constexpr (kGRegs) return g[k]; else return load<V>(grow + k * L); };
    int32_t j = crow[r];
    const int32_t end = crow[r + 1];
    for (; j + 3 < end; j += 4) {
      const T* x0 = tile + static_cast<int64_t>(col[j]) * TT;
      const T* x1 = tile + static_cast<int64_t>(col[j + 1]) * TT;
      const T* x2 = tile + static_cast<int64_t>(col[j + 2]) * TT;
      const T* x3 = tile + static_cast<int64_t>(col[j + 3]) * TT;
      // Two sums per non-zero (even / odd vectors): 8 independent FMA chains.
      V s[2][4] = {};
      for (int k = 0; k < NV; ++k) {
        const V gk = gv(k);
        s[k & 1][0] += gk * load<V>(x0 + k * L);
        s[k & 1][1] += gk * load<V>(x1 + k * L);
        s[k & 1][2] += gk * load<V>(x2 + k * L);
        s[k & 1][3] += gk * load<V>(x3 + k * L);
      }
      store(out + j, load<V4>(out + j) + hsum4<T, L>(s[0][0] + s[1][0], s[0][1] + s[1][1],
                                                     s[0][2] + s[1][2], s[0][3] + s[1][3]));
    }
    for (; j < end; ++j) {
      const T* x0 = tile + static_cast<int64_t>(col[j]) * TT;
      V s0{};
      for (int k = 0; k < NV; ++k) s0 += gv(k) * load<V>(x0 + k * L);
      const V z{};
      out[j] += hsum4<T, L>(s0, z, z, z)[0];
    }
  }
}

// tile[(f - f0) * TT + i] = src[(t0 + i) * ld + f] for f in [f0, f1); lanes i >= tt are zeroed.
template <typename T, int TT>
static void pack_tile(const T* src, int64_t ld, int64_t t0, int64_t tt, int64_t f0, int64_t f1,
                      T* tile) {
  int64_t fdone = f0;
#ifdef LDSPARSE_HAS_SHUFFLEVECTOR
  if constexpr (kTranspose8<T, TT>) {  // 8 tokens x 8 features at a time, transposed in registers
    using V8 = typename Vec<T, 8>::type;
    const int64_t tt8 = tt & ~int64_t(7), f8 = f0 + ((f1 - f0) & ~int64_t(7));
    for (int64_t fb = f0; fb < f8; fb += 8) {
      T* dst = tile + (fb - f0) * TT;
      for (int64_t i8 = 0; i8 < tt8; i8 += 8) {
        V8 a[8], o[8];
        for (int k = 0; k < 8; ++k) a[k] = load<V8>(src + (t0 + i8 + k) * ld + fb);
        transpose8<T>(a, o);
        for (int m = 0; m < 8; ++m) store(dst + m * TT + i8, o[m]);
      }
      for (int64_t i = tt8; i < tt; ++i)
        for (int64_t f = 0; f < 8; ++f) dst[f * TT + i] = src[(t0 + i) * ld + fb + f];
      for (int64_t f = 0; f < 8; ++f)
        for (int64_t i = tt; i < TT; ++i) dst[f * TT + i] = T(0);
    }
    fdone = f8;
  }
#endif
  constexpr int64_t FB = 16;  // 16 source features per pass: one cache line per token read
  for (int64_t fb = fdone; fb < f1; fb += FB) {
    const int64_t fe = fb + FB < f1 ? fb + FB : f1;
    T* dst = tile + (fb - f0) * TT;
    for (int64_t i = 0; i < tt; ++i) {
      const T* s = src + (t0 + i) * ld + fb;
      for (int64_t f = 0; f < fe - fb; ++f) dst[f * TT + i] = s[f];
    }
    for (int64_t f = 0; f < fe - fb; ++f)
      for (int64_t i = tt; i < TT; ++i) dst[f * TT + i] = T(0);
  }
}

}  // namespace LDSPARSE_ISA
}  // namespace ldsparse
