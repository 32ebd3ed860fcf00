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
