// Op schemas (namespace `ldsparse`) and the Python module entry point.
//
// Kernels register per device (sparse_cpu.cpp, cuda/*_binding.cpp); autograd and fake
// (meta) implementations are registered from Python (lightning_dynmo/sparse/_ops.py) so
// the ops compose with autograd and torch.compile.
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu_dispatch.h"

TORCH_LIBRARY(ldsparse, m) {
  // Y[t, r] = bias[r] + sum_k W[r, k] x[t, k]  (W in CSR with int32 indices).
  m.def("spmm(Tensor crow, Tensor col, Tensor values, Tensor x, Tensor? bias) -> Tensor");
  // out[j] = sum_t g[t, row(j)] x[t, col(j)]: the weight gradient restricted to the pattern.
  m.def("sddmm(Tensor crow, Tensor col, Tensor g, Tensor x) -> Tensor");
  // CSR of W^T and the permutation with values_t = values[perm].
  m.def("csr_transpose(Tensor crow, Tensor col, int n_cols) -> (Tensor, Tensor, Tensor)");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_dynmo sparse kernels (schemas + CPU); ops live under torch.ops.ldsparse";
  m.def("cpu_isa", &ldsparse::selected_isa, "Instruction set the CPU kernels dispatch to");
  m.def("set_cpu_isa", &ldsparse::set_cpu_isa, "Narrow the CPU kernels' ISA; False if unsupported");
}
