// CUDA kernels for block-sparse causal attention (torch-free: CUDA runtime headers only, so CI
// compile-checks them with plain nvcc; attention_cuda.cu is the torch binding).  Same
// algorithm, layout format and slot semantics as the CPU kernels (attention_kernels.h,
// attention_cpu.cpp):
//
// Forward (FlashAttention-2 outer loop over queries): one CTA per (batch*head, query tile of TB
// slots); for every key block of the tile's layout row, key sub-tiles of TB slots are staged in
// shared memory, S = Q K^T is computed from a register-tiled 2-D thread layout, online softmax
// in the log2 domain (exp2), O += P V; O / l and lse (natural log) at the end.
// Backward (FA-2 outer loop over keys, via the transposed layout): one CTA per (batch*head, key
// tile); dK, dV accumulate in registers over the query tiles that see the key tile; dQ goes
// through fp32 atomics into a slot-ordered buffer that attn_dq_finish scales and scatters.
//
// SIMT (FFMA) kernels with fp32 accumulation for fp32 and bf16 storage: portable to every
// architecture the extension is built for, and exact enough for the tests; a tensor-core path
// (mma.sync / wgmma) is the next step for speed (see lightning_dynmo/sparse/attention.py).
//
// Thread layout: 128 threads = 16 row groups x 8 column groups; a thread owns RM = TB / 16
// rows and RN = TB / 8 columns (interleaved, column c at tx + 8 c) of each TB x TB score tile
// and DC interleaved head-dim columns (d = tx + 8 c) of the output rows it owns, so a score
// row's reductions are 3 shuffles within 8 lanes.  Shared tiles have an odd row pitch (D + 1,
// TB + 1), which keeps every access pattern below free of bank conflicts.
// TB in {16, 32, 64} divides the layout block size; a layout block is processed as
// (BS / TB)^2 sub-tile pairs (sub-tiles past the causal diagonal are skipped).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <type_traits>

#include "attention_params.h"

namespace ldsparse {
namespace cuda {
namespace attn {

constexpr int kThreads = 128;
constexpr int kColGroups = 8;
constexpr int kRowGroups = kThreads / kColGroups;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// Rows of the TB slots whose tokens are toks[] into tile[TB][ld] (fp32, times scale); zero
// rows for padding.  Consecutive threads read consecutive features: coalesced.
template <typename T, int TB>
__device__ __forceinline__ void load_tile(float* tile, int ld, const Src<T>& src, int b, int h,
                                          const int* toks, int D, float scale) {
  for (int e = threadIdx.x; e < TB * D; e += kThreads) {
    const int r = e / D, d = e - r * D;
    const int tok = toks[r];
    tile[r * ld + d] = tok >= 0 ? to_f(src.row(b, h, tok)[d]) * scale : 0.f;
  }
}

template <int W>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = 1; o < W; o *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
template <int W>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = 1; o < W; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Dynamic shared memory of the kernels, in bytes.
inline size_t fwd_smem(int tb, int d) { return sizeof(float) * (3 * tb * (d + 1) + tb * (tb + 1)); }
inline size_t bwd_smem(int tb, int d) { return sizeof(float) * (4 * tb * (d + 1) + 2 * tb * (tb + 1)); }

// grid = (ceil(S / TB), B * H), block = kThreads, dynamic smem = fwd_smem(TB, D).
template <typename T, int TB, int DC>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const FwdParams<T> p) {
  constexpr int RM = TB / kRowGroups, RN = TB / kColGroups;
  static_assert(RM >= 1 && RN >= 1, "tile too small for the thread layout");
  extern __shared__ float smem[];
  __shared__ int qtok[TB], ktok[TB];
  __shared__ float kbias[TB];
  const Geom& g = p.g;
  const int ld = g.D + 1, lp = TB + 1;
  float* Qs = smem;
  float* Ks = Qs + TB * ld;
  float* Vs = Ks + TB * ld;
  float* Ps = Vs + TB * ld;
  const int bh = blockIdx.y, b = bh / g.H, h = bh - b * g.H;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * TB;  // late tiles (long causal rows) first
  const int qb = q0 / g.bs;
  const int tid = threadIdx.x, ty = tid / kColGroups, tx = tid % kColGroups;
  if (tid < TB) qtok[tid] = g.token(bh, q0 + tid);
  __syncthreads();
  load_tile<T, TB>(Qs, ld, p.q, b, h, qtok, g.D, g.scale);

  float m[RM], l[RM], o[RM][DC];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < DC; ++c) o[r][c] = 0.f;
  }
  const int32_t* rp = p.row_ptr + static_cast<int64_t>(bh) * (g.nblk + 1);
  const int q_last = min(q0 + TB, g.S) - 1;
  for (int e = rp[qb]; e < rp[qb + 1]; ++e) {
    const int kb = p.col_idx[e];
    const int k_end = min((kb + 1) * g.bs, g.S);
    for (int k0 = kb * g.bs; k0 < k_end && k0 <= q_last; k0 += TB) {  // sub-tiles past the diagonal: skipped
      __syncthreads();  // the previous sub-tile's readers are done
      if (tid < TB) {
        ktok[tid] = g.token(bh, k0 + tid);
        kbias[tid] = ktok[tid] >= 0 ? 0.f : -INFINITY;  // padding slots are no keys
      }
      __syncthreads();
      load_tile<T, TB>(Ks, ld, p.k, b, h, ktok, g.D, 1.f);
      load_tile<T, TB>(Vs, ld, p.v, b, h, ktok, g.D, 1.f);
      __syncthreads();

      float s[RM][RN];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < RN; ++c) s[r][c] = 0.f;
      for (int d = 0; d < g.D; ++d) {
        float qv[RM], kv[RN];
#pragma unroll
        for (int r = 0; r < RM; ++r) qv[r] = Qs[(ty * RM + r) * ld + d];
#pragma unroll
        for (int c = 0; c < RN; ++c) kv[c] = Ks[(tx + c * kColGroups) * ld + d];
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
          for (int c = 0; c < RN; ++c) s[r][c] = fmaf(qv[r], kv[c], s[r][c]);
      }

      const bool diag = kb == qb;
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        const int i = q0 + ty * RM + r;
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < RN; ++c) {
          const int jl = tx + c * kColGroups;
          float x = s[r][c] * kLog2e + kbias[jl];
          if (diag && k0 + jl > i) x = -INFINITY;
          s[r][c] = x;
          mx = fmaxf(mx, x);
        }
        const float m_new = fmaxf(m[r], group_max<kColGroups>(mx));
        float rs = 0.f, alpha = 1.f;
        if (m_new == -INFINITY) {  // nothing visible yet
#pragma unroll
          for (int c = 0; c < RN; ++c) s[r][c] = 0.f;
        } else {
          alpha = exp2f(m[r] - m_new);
#pragma unroll
          for (int c = 0; c < RN; ++c) {
            s[r][c] = exp2f(s[r][c] - m_new);
            rs += s[r][c];
          }
        }
        l[r] = l[r] * alpha + group_sum<kColGroups>(rs);
        m[r] = m_new;
#pragma unroll
        for (int c = 0; c < DC; ++c) o[r][c] *= alpha;
#pragma unroll
        for (int c = 0; c < RN; ++c) Ps[(ty * RM + r) * lp + tx + c * kColGroups] = s[r][c];
      }
      __syncthreads();
      for (int j = 0; j < TB; ++j) {
        float pv[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) pv[r] = Ps[(ty * RM + r) * lp + j];
#pragma unroll
        for (int c = 0; c < DC; ++c) {
          const int d = tx + c * kColGroups;
          const float vv = d < g.D ? Vs[j * ld + d] : 0.f;
#pragma unroll
          for (int r = 0; r < RM; ++r) o[r][c] = fmaf(pv[r], vv, o[r][c]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const int il = ty * RM + r, slot = q0 + il;
    if (slot >= g.S) continue;
    const bool seen = l[r] > 0.f;  // else an empty layout row: output 0, like SDPA
    if (tx == 0) p.lse[static_cast<int64_t>(bh) * g.S + slot] = seen ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
    const int tok = qtok[il];
    if (tok < 0) continue;
    const float inv = seen ? 1.f / l[r] : 0.f;
    T* dst = p.out + (static_cast<int64_t>(bh) * g.T + tok) * g.D;
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int d = tx + c * kColGroups;
      if (d < g.D) dst[d] = from_f<T>(o[r][c] * inv);
    }
  }
}

// grid = (ceil(S / TB), B * H), block = kThreads, dynamic smem = bwd_smem(TB, D).
template <typename T, int TB, int DC>
__global__ void __launch_bounds__(kThreads) bwd_kernel(const BwdParams<T> p) {
  constexpr int RM = TB / kRowGroups, RN = TB / kColGroups;
  extern __shared__ float smem[];
  __shared__ int qtok[TB], ktok[TB];
  __shared__ float kbias[TB], lse2[TB], dlt[TB];
  const Geom& g = p.g;
  const int ld = g.D + 1, lp = TB + 1;
  float* Ks = smem;
  float* Vs = Ks + TB * ld;
  float* Qs = Vs + TB * ld;
  float* Ds = Qs + TB * ld;  // dO
  float* Ps = Ds + TB * ld;  // P^T  [key][query]
  float* Ss = Ps + TB * lp;  // dS^T [key][query]
  const int bh = blockIdx.y, b = bh / g.H, h = bh - b * g.H;
  const int k0 = blockIdx.x * TB, kb = k0 / g.bs;
  const int tid = threadIdx.x, ty = tid / kColGroups, tx = tid % kColGroups;
  if (tid < TB) {
    ktok[tid] = g.token(bh, k0 + tid);
    kbias[tid] = ktok[tid] >= 0 ? 0.f : -INFINITY;
  }
  __syncthreads();
  load_tile<T, TB>(Ks, ld, p.k, b, h, ktok, g.D, 1.f);
  load_tile<T, TB>(Vs, ld, p.v, b, h, ktok, g.D, 1.f);

  float dk[RM][DC], dv[RM][DC];  // rows: this thread's keys
#pragma unroll
  for (int r = 0; r < RM; ++r)
#pragma unroll
    for (int c = 0; c < DC; ++c) dk[r][c] = dv[r][c] = 0.f;
  const int32_t* cp = p.col_ptr + static_cast<int64_t>(bh) * (g.nblk + 1);
  const int k_last = min(k0 + TB, g.S) - 1;
  for (int e = cp[kb]; e < cp[kb + 1]; ++e) {
    const int qb = p.row_idx[e];
    const int q_end = min((qb + 1) * g.bs, g.S);
    for (int q0 = qb * g.bs; q0 < q_end; q0 += TB) {
      if (q0 + TB - 1 < k0) continue;  // every query before every key of the tile
      __syncthreads();
      if (tid < TB) {
        const int s = q0 + tid, tok = g.token(bh, s);
        qtok[tid] = tok;
        const float l = s < g.S ? p.lse[static_cast<int64_t>(bh) * g.S + s] : -INFINITY;
        lse2[tid] = l == -INFINITY ? INFINITY : l * kLog2e;  // a row that saw no key: P = 0
        dlt[tid] = tok >= 0 ? p.delta[static_cast<int64_t>(bh) * g.T + tok] : 0.f;
      }
      __syncthreads();
      load_tile<T, TB>(Qs, ld, p.q, b, h, qtok, g.D, g.scale);
      load_tile<T, TB>(Ds, ld, p.dout, b, h, qtok, g.D, 1.f);
      __syncthreads();

      // S^T and dP^T for this thread's keys (rows) and queries (columns).
      float st[RM][RN], dpt[RM][RN];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < RN; ++c) st[r][c] = dpt[r][c] = 0.f;
      for (int d = 0; d < g.D; ++d) {
        float kv[RM], vv[RM], qv[RN], ov[RN];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
          kv[r] = Ks[(ty * RM + r) * ld + d];
          vv[r] = Vs[(ty * RM + r) * ld + d];
        }
#pragma unroll
        for (int c = 0; c < RN; ++c) {
          qv[c] = Qs[(tx + c * kColGroups) * ld + d];
          ov[c] = Ds[(tx + c * kColGroups) * ld + d];
        }
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
          for (int c = 0; c < RN; ++c) {
            st[r][c] = fmaf(kv[r], qv[c], st[r][c]);
            dpt[r][c] = fmaf(vv[r], ov[c], dpt[r][c]);
          }
      }
      const bool diag = kb == qb;
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        const int jl = ty * RM + r;
#pragma unroll
        for (int c = 0; c < RN; ++c) {
          const int il = tx + c * kColGroups;
          float pr = exp2f(st[r][c] * kLog2e + kbias[jl] - lse2[il]);
          if (diag && k0 + jl > q0 + il) pr = 0.f;
          Ps[jl * lp + il] = pr;
          Ss[jl * lp + il] = pr * (dpt[r][c] - dlt[il]);
        }
      }
      __syncthreads();
      // dV[j] += sum_i P[i][j] dO[i];  dK[j] += sum_i dS[i][j] Qs[i]
      for (int i = 0; i < TB; ++i) {
        float pv[RM], sv[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
          pv[r] = Ps[(ty * RM + r) * lp + i];
          sv[r] = Ss[(ty * RM + r) * lp + i];
        }
#pragma unroll
        for (int c = 0; c < DC; ++c) {
          const int d = tx + c * kColGroups;
          const float ov = d < g.D ? Ds[i * ld + d] : 0.f, qv = d < g.D ? Qs[i * ld + d] : 0.f;
#pragma unroll
          for (int r = 0; r < RM; ++r) {
            dv[r][c] = fmaf(pv[r], ov, dv[r][c]);
            dk[r][c] = fmaf(sv[r], qv, dk[r][c]);
          }
        }
      }
      // dQ[i] += sum_j dS[i][j] K[j]: rows of this thread now index queries.
      float dq[RM][DC];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < DC; ++c) dq[r][c] = 0.f;
      for (int j = 0; j <= k_last - k0; ++j) {
        float sv[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) sv[r] = Ss[j * lp + ty * RM + r];
#pragma unroll
        for (int c = 0; c < DC; ++c) {
          const int d = tx + c * kColGroups;
          const float kv = d < g.D ? Ks[j * ld + d] : 0.f;
#pragma unroll
          for (int r = 0; r < RM; ++r) dq[r][c] = fmaf(sv[r], kv, dq[r][c]);
        }
      }
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        const int slot = q0 + ty * RM + r;
        if (slot >= g.S || qtok[ty * RM + r] < 0) continue;
        float* dst = p.dq_acc + (static_cast<int64_t>(bh) * g.S + slot) * g.D;
#pragma unroll
        for (int c = 0; c < DC; ++c) {
          const int d = tx + c * kColGroups;
          if (d < g.D) atomicAdd(dst + d, dq[r][c]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const int tok = ktok[ty * RM + r];
    if (tok < 0) continue;
    T* dkr = p.dk + (static_cast<int64_t>(bh) * g.T + tok) * g.D;
    T* dvr = p.dv + (static_cast<int64_t>(bh) * g.T + tok) * g.D;
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int d = tx + c * kColGroups;
      if (d < g.D) {
        dkr[d] = from_f<T>(dk[r][c]);
        dvr[d] = from_f<T>(dv[r][c]);
      }
    }
  }
}

// dq[bh][token][:] = scale * dq_acc[bh][slot][:] for every slot that holds a token.
template <typename T>
__global__ void dq_finish_kernel(const Geom g, int heads, const float* __restrict__ dq_acc, T* __restrict__ dq) {
  const int64_t n = static_cast<int64_t>(heads) * g.S * g.D;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / g.D;
    const int d = static_cast<int>(e - row * g.D), bh = static_cast<int>(row / g.S), slot = static_cast<int>(row % g.S);
    const int tok = g.token(bh, slot);
    if (tok >= 0) dq[(static_cast<int64_t>(bh) * g.T + tok) * g.D + d] = from_f<T>(dq_acc[e] * g.scale);
  }
}

// ---------------------------------------------------------------------------- launchers
// Sub-tile TB and per-thread head-dim columns DC for a layout block size and head dim:
// TB = min(BS, 64) for D <= 64, min(BS, 32) up to D = 128 (registers and shared memory).
inline int pick_tile(int bs, int d) { return bs < 32 ? 16 : (bs < 64 || d > 64 ? 32 : 64); }
inline int pick_dc(int d) { return d <= 32 ? 4 : (d <= 64 ? 8 : 16); }

// Calls f(TB, DC) (as integral constants) for the instantiated combinations.
template <typename F>
cudaError_t dispatch(int tb, int dc, F&& f) {
  using I16 = std::integral_constant<int, 16>;
  using I32 = std::integral_constant<int, 32>;
  using I64 = std::integral_constant<int, 64>;
  using D4 = std::integral_constant<int, 4>;
  using D8 = std::integral_constant<int, 8>;
  using D16 = std::integral_constant<int, 16>;
  if (tb == 16) return dc == 4 ? f(I16{}, D4{}) : dc == 8 ? f(I16{}, D8{}) : f(I16{}, D16{});
  if (tb == 32) return dc == 4 ? f(I32{}, D4{}) : dc == 8 ? f(I32{}, D8{}) : f(I32{}, D16{});
  if (tb == 64 && dc <= 8) return dc == 4 ? f(I64{}, D4{}) : f(I64{}, D8{});
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_fwd(const FwdParams<T>& p, int heads, cudaStream_t stream) {
  if (p.g.D > kMaxHeadDim) return cudaErrorInvalidValue;
  if (p.g.S == 0 || heads == 0) return cudaSuccess;
  const int tb = pick_tile(p.g.bs, p.g.D), dc = pick_dc(p.g.D);
  const size_t smem = fwd_smem(tb, p.g.D);
  const dim3 grid((p.g.S + tb - 1) / tb, heads);
  return dispatch(tb, dc, [&](auto tb_c, auto dc_c) {
    auto kernel = fwd_kernel<T, decltype(tb_c)::value, decltype(dc_c)::value>;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  });
}

template <typename T>
cudaError_t launch_bwd(const BwdParams<T>& p, int heads, T* dq, cudaStream_t stream) {
  if (p.g.D > kMaxHeadDim) return cudaErrorInvalidValue;
  if (p.g.S == 0 || heads == 0) return cudaSuccess;
  const int tb = pick_tile(p.g.bs, p.g.D), dc = pick_dc(p.g.D);
  const size_t smem = bwd_smem(tb, p.g.D);
  const dim3 grid((p.g.S + tb - 1) / tb, heads);
  const cudaError_t err = dispatch(tb, dc, [&](auto tb_c, auto dc_c) {
    auto kernel = bwd_kernel<T, decltype(tb_c)::value, decltype(dc_c)::value>;
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    kernel<<<grid, kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  const int64_t n = static_cast<int64_t>(heads) * p.g.S * p.g.D;
  const int blocks = static_cast<int>((n + 255) / 256 < 65535 * 4 ? (n + 255) / 256 : 65535 * 4);
  dq_finish_kernel<T><<<blocks, 256, 0, stream>>>(p.g, heads, p.dq_acc, dq);
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace cuda
}  // namespace ldsparse
