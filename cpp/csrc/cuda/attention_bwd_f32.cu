// nvcc translation unit: the block-sparse attention backward kernels for float
// (attention_kernels.cuh).  One unit per direction and dtype keeps each small and lets the
// build compile them in parallel; no torch header is included (build time).
#include "attention_kernels.cuh"
#include "launchers.h"

namespace ldsparse {
namespace cuda {

cudaError_t attn_bwd(const attn::BwdParams<float>& p, int heads, float* dq, cudaStream_t stream) {
  return attn::launch_bwd<float>(p, heads, dq, stream);
}

}  // namespace cuda
}  // namespace ldsparse
