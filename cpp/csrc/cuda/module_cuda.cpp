// Python entry point of `lightning_dynmo.sparse._C_cuda`, the CUDA kernels' own module (built
// apart from _C_cpu so a failed or skipped CUDA build keeps the CPU kernels).
// Importing it registers the CUDA implementations (sparse_binding.cpp, attention_binding.cpp)
// on the schemas that _C_cpu defines, so lightning_dynmo.sparse._ops imports _C_cpu first.
// A bare CPython module: it exports nothing, and torch/extension.h alone took ~40 s to compile.
#include <Python.h>

#define LDSPARSE_CAT_(a, b) a##b
#define LDSPARSE_CAT(a, b) LDSPARSE_CAT_(a, b)
#define LDSPARSE_STR_(a) #a
#define LDSPARSE_STR(a) LDSPARSE_STR_(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, LDSPARSE_STR(TORCH_EXTENSION_NAME),
                                 "lightning_dynmo sparse CUDA kernels; ops live under torch.ops.ldsparse", -1,
                                 nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC LDSPARSE_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
