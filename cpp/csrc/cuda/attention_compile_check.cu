// Torch-free translation unit for CI: instantiates every block-sparse attention kernel so
// `nvcc -c` catches rot in attention_kernels.cuh without a CUDA build of torch
// (see check_cuda_compile.sh).
#include "attention_kernels.cuh"

namespace ldsparse {
namespace cuda {
namespace attn {
template cudaError_t launch_fwd<float>(const FwdParams<float>&, int, cudaStream_t);
template cudaError_t launch_fwd<__nv_bfloat16>(const FwdParams<__nv_bfloat16>&, int, cudaStream_t);
template cudaError_t launch_bwd<float>(const BwdParams<float>&, int, float*, cudaStream_t);
template cudaError_t launch_bwd<__nv_bfloat16>(const BwdParams<__nv_bfloat16>&, int, __nv_bfloat16*, cudaStream_t);
}  // namespace attn
}  // namespace cuda
}  // namespace ldsparse
