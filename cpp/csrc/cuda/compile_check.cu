// Torch-free translation unit for CI: instantiates every kernel so `nvcc -c` catches rot
// in sparse_kernels.cuh on machines without a CUDA build of torch (see check_cuda_compile.sh).
#include "sparse_kernels.cuh"

namespace ldsparse {
namespace cuda {
template cudaError_t launch_spmm<float>(const int32_t*, const int32_t*, const float*, const float*,
                                        const float*, const int32_t*, float*, int, int, cudaStream_t);
template cudaError_t launch_spmm<__nv_bfloat16>(const int32_t*, const int32_t*, const __nv_bfloat16*,
                                                const __nv_bfloat16*, const __nv_bfloat16*,
                                                const int32_t*, __nv_bfloat16*, int, int, cudaStream_t);
template cudaError_t launch_sddmm<float>(const int32_t*, const int32_t*, const float*, const float*,
                                         const int32_t*, float*, int, int, cudaStream_t);
template cudaError_t launch_sddmm<__nv_bfloat16>(const int32_t*, const int32_t*, const __nv_bfloat16*,
                                                 const __nv_bfloat16*, const int32_t*, __nv_bfloat16*,
                                                 int, int, cudaStream_t);
}  // namespace cuda
}  // namespace ldsparse
