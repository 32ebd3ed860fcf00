// nvcc translation unit: the block-sparse attention forward kernels for float
// (attention_kernels.cuh).  One unit per direction and dtype keeps each small and lets the
// build compile them in parallel; no torch header is included (build time).
#include "attention_kernels.cuh"
#include "launchers.h"

namespace ldsparse {
namespace cuda {

cudaError_t attn_fwd(const attn::FwdParams<float>& p, int heads, cudaStream_t stream) {
  return attn::launch_fwd<float>(p, heads, stream);
}

}  // namespace cuda
}  // namespace ldsparse
