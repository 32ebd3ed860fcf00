// Python entry point of `lightning_dynmo.sparse._C_cuda`, the CUDA kernels' own module (built
// apart from _C_cpu so a failed or skipped CUDA build keeps the CPU kernels, issue 32).
// Importing it registers the CUDA implementations (sparse_binding.cpp, attention_binding.cpp) on the
// schemas that _C_cpu defines, so lightning_dynmo.sparse._ops imports _C_cpu first.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_dynmo sparse CUDA kernels; ops live under torch.ops.ldsparse";
}
