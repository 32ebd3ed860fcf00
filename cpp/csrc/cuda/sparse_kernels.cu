// nvcc translation unit of the sparse-linear kernels (sparse_kernels.cuh): defines the
// torch-free launchers of launchers.h.  No torch header is included here (build time).
#include "launchers.h"
#include "sparse_kernels.cuh"

namespace ldsparse {
namespace cuda {

int spmm_chunk_count(int64_t in_features) { return spmm_chunks(in_features); }

cudaError_t spmm_build_chunk_ptr(const int32_t* crow, const int32_t* col, int32_t* chunk_ptr, int rows,
                                 int chunks, cudaStream_t stream) {
  return launch_chunk_ptr(crow, col, chunk_ptr, rows, chunks, stream);
}

cudaError_t spmm(Dtype dtype, const int32_t* chunk_ptr, const int32_t* col, const void* values, const void* x,
                 const void* bias, void* y, int rows, int K, int n, int chunks, bool staged, cudaStream_t stream) {
  if (dtype == Dtype::f32 && staged)
    return launch_spmm_staged(chunk_ptr, col, static_cast<const float*>(values), static_cast<const float*>(x),
                              static_cast<const float*>(bias), static_cast<float*>(y), rows, K, n, chunks, stream);
  if (dtype == Dtype::f32)
    return launch_spmm<float>(chunk_ptr, col, static_cast<const float*>(values), static_cast<const float*>(x),
                              static_cast<const float*>(bias), static_cast<float*>(y), rows, K, n, chunks, stream);
  using B = __nv_bfloat16;
  return launch_spmm<B>(chunk_ptr, col, static_cast<const B*>(values), static_cast<const B*>(x),
                        static_cast<const B*>(bias), static_cast<B*>(y), rows, K, n, chunks, stream);
}

namespace {
template <class Fn>
auto with_tile(int variant, Fn fn) {
  if (variant == 4) return fn(StreamV4{});
  if (variant == 5) return fn(StreamV5{});
  return fn(StreamV3{});
}
}  // namespace

int spmm_stream_tile_rows(int variant) {
  return with_tile(variant, [](auto tile) { return decltype(tile)::kRows; });
}

int64_t spmm_stream_scan_size(int rows, int chunks, int variant) {
  const int64_t tile = spmm_stream_tile_rows(variant);
  return (static_cast<int64_t>(rows) + tile - 1) / tile * chunks * tile + 1;
}

cudaError_t spmm_stream_scatter(const int32_t* chunk_ptr, const int32_t* col, const float* values,
                                const int32_t* scan, int32_t* stream, int rows, int chunks, int variant,
                                cudaStream_t cuda_stream) {
  return with_tile(variant, [&](auto tile) {
    using Tile = decltype(tile);
    return launch_spmm_stream_scatter(chunk_ptr, col, values, scan, reinterpret_cast<int2*>(stream), rows, chunks,
                                      Tile::kRows, Tile::kPitch, cuda_stream);
  });
}

cudaError_t spmm_stream(const int32_t* scan, const int32_t* stream, const float* x, const float* bias, float* y,
                        int rows, int K, int n, int chunks, int variant, cudaStream_t cuda_stream) {
  return with_tile(variant, [&](auto tile) {
    return launch_spmm_stream<decltype(tile)>(scan, reinterpret_cast<const int2*>(stream), x, bias, y, rows, K, n,
                                              chunks, cuda_stream);
  });
}

cudaError_t csr_gather(Dtype dtype, const int32_t* crow, const int32_t* col, const void* dense, void* out,
                       int rows, int K, cudaStream_t stream) {
  if (dtype == Dtype::f32)
    return launch_csr_gather<float>(crow, col, static_cast<const float*>(dense), static_cast<float*>(out), rows,
                                    K, stream);
  using B = __nv_bfloat16;
  return launch_csr_gather<B>(crow, col, static_cast<const B*>(dense), static_cast<B*>(out), rows, K, stream);
}

}  // namespace cuda
}  // namespace ldsparse
