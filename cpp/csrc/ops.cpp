// Op schemas (namespace `ldsparse`), registered when the module loads.
//
// Kernels register per device (sparse_cpu.cpp, cuda/*_binding.cpp); autograd and fake
// (meta) implementations are registered from Python (lightning_dynmo/sparse/_ops.py) so
// the ops compose with autograd and torch.compile.  Only torch/library.h here: the full
// torch/extension.h cost ~45 s of compile time on its own.
#include <torch/library.h>

TORCH_LIBRARY(ldsparse, m) {
  // Y[t, r] = bias[r] + sum_k W[r, k] x[t, k]  (W in CSR with int32 indices).
  m.def("spmm(Tensor crow, Tensor col, Tensor values, Tensor x, Tensor? bias) -> Tensor");
  // out[j] = sum_t g[t, row(j)] x[t, col(j)]: the weight gradient restricted to the pattern.
  m.def("sddmm(Tensor crow, Tensor col, Tensor g, Tensor x) -> Tensor");
  // CSR of W^T and the permutation with values_t = values[perm].
  m.def("csr_transpose(Tensor crow, Tensor col, int n_cols) -> (Tensor, Tensor, Tensor)");
}
