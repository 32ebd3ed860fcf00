// Python entry point of `lightning_dynmo.sparse._C_cpu` (pybind11 only, no torch headers: fast
// to compile).  The op schemas (ops.cpp) and CPU kernels register when the module loads.
#include <pybind11/pybind11.h>

#include "cpu_dispatch.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_dynmo sparse kernels (schemas + CPU); ops live under torch.ops.ldsparse";
  m.def("cpu_isa", &ldsparse::selected_isa, "Instruction set the CPU kernels dispatch to");
  m.def("set_cpu_isa", &ldsparse::set_cpu_isa, "Narrow the CPU kernels' ISA; False if unsupported");
}
