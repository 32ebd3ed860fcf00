// Sputnik-style CUDA kernels for CSR SpMM and SDDMM (torch-free: CUDA runtime headers only,
// so CI can compile-check them with plain nvcc; sparse_cuda.cu is the thin torch binding).
//
// Operands are feature-major: xt[k * n + t] (the binding transposes token-major
// activations), so a CSR row reads contiguous token strips.  Ideas taken from Sputnik
// (Gale et al., SC'20):
//   * 1-D tiling: a warp owns one output row and strips of 32 * VEC tokens;
//   * row swizzle: warps take rows in `row_order` (sorted by decreasing nnz) so rows of
//     similar length run together and the long ones start first;
//   * vector memory access: VEC tokens per lane in one 16-byte load/store;
//   * the row's (value, col) pairs are loaded cooperatively, one per lane, and broadcast
//     with warp shuffles.
// Accumulation is fp32 for every storage type (fp32, bf16).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace ldsparse {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 4;  // warps per block, one row each
constexpr unsigned kMaxGridY = 65535;  // CUDA's limit on gridDim.y

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Packed {  // VEC elements moved by one vector instruction
  T v[VEC];
};

// yt[r * n + t] = bias[r] + sum_j values[j] * xt[col[j] * n + t].
// grid = (ceil(rows / kRowsPerBlock), min(strips, kMaxGridY)), block = (32, kRowsPerBlock), where
// strips = ceil(n / (32 * VEC)); a block walks strips blockIdx.y, + gridDim.y, ... so any n
// fits (grid.y alone stops at 65535 strips: 2M tokens on the scalar path).
// n % VEC == 0 and 16-byte aligned bases are required when VEC > 1.
template <typename T, int VEC>
__global__ void spmm_kernel(const int32_t* __restrict__ crow, const int32_t* __restrict__ col,
                            const T* __restrict__ values, const T* __restrict__ xt,
                            const T* __restrict__ bias, const int32_t* __restrict__ row_order,
                            T* __restrict__ yt, int rows, int n) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (slot >= rows) return;
  const int r = row_order ? row_order[slot] : static_cast<int>(slot);
  const int lane = threadIdx.x;
  const float b = bias ? to_float(bias[r]) : 0.f;
  const int begin = crow[r], end = crow[r + 1];
  const int64_t strips = (static_cast<int64_t>(n) + kWarp * VEC - 1) / (kWarp * VEC);
  for (int64_t strip = blockIdx.y; strip < strips; strip += gridDim.y) {  // warp-uniform
    const int64_t t = (strip * kWarp + lane) * VEC;
    const bool active = t < n;
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = b;
    for (int base = begin; base < end; base += kWarp) {
      const int mine = base + lane;
      const float w_l = mine < end ? to_float(values[mine]) : 0.f;
      const int c_l = mine < end ? col[mine] : 0;
      const int count = min(kWarp, end - base);
      for (int i = 0; i < count; ++i) {
        const float w = __shfl_sync(0xffffffffu, w_l, i);
        const int c = __shfl_sync(0xffffffffu, c_l, i);
        if (active) {
          const Packed<T, VEC> x =
              *reinterpret_cast<const Packed<T, VEC>*>(xt + static_cast<int64_t>(c) * n + t);
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[v] = fmaf(w, to_float(x.v[v]), acc[v]);
        }
      }
    }
    if (active) {
      Packed<T, VEC> out;
#pragma unroll
      for (int v = 0; v < VEC; ++v) out.v[v] = from_float<T>(acc[v]);
      *reinterpret_cast<Packed<T, VEC>*>(yt + static_cast<int64_t>(r) * n + t) = out;
    }
  }
}

// out[j] = sum_t gt[row(j) * n + t] * xt[col[j] * n + t]: one warp per row (swizzled),
// lanes stride the token dimension with vector loads, warp-shuffle reduction per non-zero.
// grid = ceil(rows / kRowsPerBlock), block = (32, kRowsPerBlock).
template <typename T, int VEC>
__global__ void sddmm_kernel(const int32_t* __restrict__ crow, const int32_t* __restrict__ col,
                             const T* __restrict__ gt, const T* __restrict__ xt,
                             const int32_t* __restrict__ row_order, T* __restrict__ out,
                             int rows, int n) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (slot >= rows) return;
  const int r = row_order ? row_order[slot] : static_cast<int>(slot);
  const int lane = threadIdx.x;
  const T* g = gt + static_cast<int64_t>(r) * n;
  for (int j = crow[r]; j < crow[r + 1]; ++j) {
    const T* x = xt + static_cast<int64_t>(col[j]) * n;
    float s = 0.f;
    for (int64_t t = static_cast<int64_t>(lane) * VEC; t < n; t += kWarp * VEC) {
      const Packed<T, VEC> gv = *reinterpret_cast<const Packed<T, VEC>*>(g + t);
      const Packed<T, VEC> xv = *reinterpret_cast<const Packed<T, VEC>*>(x + t);
#pragma unroll
      for (int v = 0; v < VEC; ++v) s = fmaf(to_float(gv.v[v]), to_float(xv.v[v]), s);
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) out[j] = from_float<T>(s);
  }
}

// Host launchers: pick the widest vector the token count and pointer alignment allow.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
cudaError_t launch_spmm(const int32_t* crow, const int32_t* col, const T* values, const T* xt,
                        const T* bias, const int32_t* row_order, T* yt, int rows, int n,
                        cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  constexpr int V = 16 / sizeof(T);
  const dim3 block(kWarp, kRowsPerBlock);
  const unsigned gx = static_cast<unsigned>((static_cast<int64_t>(rows) + kRowsPerBlock - 1) / kRowsPerBlock);
  // Token strips beyond kMaxGridY are looped over inside the kernel.
  const auto grid = [&](int vec) {
    const int64_t strips = (static_cast<int64_t>(n) + kWarp * vec - 1) / (kWarp * vec);
    return dim3(gx, static_cast<unsigned>(strips < kMaxGridY ? strips : kMaxGridY));
  };
  if (n % V == 0 && aligned16(xt) && aligned16(yt))
    spmm_kernel<T, V><<<grid(V), block, 0, stream>>>(crow, col, values, xt, bias, row_order, yt, rows, n);
  else
    spmm_kernel<T, 1><<<grid(1), block, 0, stream>>>(crow, col, values, xt, bias, row_order, yt, rows, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_sddmm(const int32_t* crow, const int32_t* col, const T* gt, const T* xt,
                         const int32_t* row_order, T* out, int rows, int n, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int V = 16 / sizeof(T);
  const dim3 block(kWarp, kRowsPerBlock);
  const dim3 grid(static_cast<unsigned>((static_cast<int64_t>(rows) + kRowsPerBlock - 1) / kRowsPerBlock));
  if (n % V == 0 && aligned16(gt) && aligned16(xt))
    sddmm_kernel<T, V><<<grid, block, 0, stream>>>(crow, col, gt, xt, row_order, out, rows, n);
  else
    sddmm_kernel<T, 1><<<grid, block, 0, stream>>>(crow, col, gt, xt, row_order, out, rows, n);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ldsparse
