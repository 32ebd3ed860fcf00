// Thin torch binding for the CUDA kernels in sparse_kernels.cuh (fp32 and bf16); inputs are
// checked as on the CPU (sparse_checks.h).  The CSR contents are trusted on the GPU (reading them
// would sync and break CUDA-graph capture); SparseLinear builds valid patterns.
// Token-major activations are transposed to the kernels' feature-major layout here; the
// row swizzle order (rows by decreasing nnz) is computed per call on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "sparse_checks.h"
#include "sparse_kernels.cuh"

namespace ldsparse {
namespace {

at::Tensor row_swizzle(const at::Tensor& crow) {
  const auto lengths = crow.slice(0, 1) - crow.slice(0, 0, -1);
  return std::get<1>(lengths.sort(/*stable=*/false, /*dim=*/0, /*descending=*/true)).to(at::kInt);
}

// The CPU op's checks (sparse_checks.h) plus what only the GPU kernels need: CUDA tensors, a
// dtype they are instantiated for, and a token count that fits their int parameter.
void check_cuda(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, " (CUDA): x must be on the GPU, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              " (CUDA): float32 or bfloat16 only, got ", x.scalar_type(),
              " (lightning_dynmo.sparse runs float16 upcast to float32)");
  check_fits_int(x.size(0), "tokens", op);
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

at::Tensor spmm_cuda(const at::Tensor& crow_in, const at::Tensor& col_in, const at::Tensor& values,
                     const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  check_spmm(crow_in, col_in, values, x, bias);
  check_cuda(x, "ldsparse.spmm");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto crow = crow_in.contiguous(), col = col_in.contiguous(), vals = values.contiguous();
  const int64_t rows = crow.numel() - 1, n = x.size(0);
  if (rows == 0 || n == 0) return at::empty({n, rows}, x.options());
  const auto xt = x.t().contiguous();  // [in_features, tokens]
  auto yt = at::empty({rows, n}, x.options());
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const auto order = row_swizzle(crow);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (x.scalar_type() == at::kFloat)
    err = cuda::launch_spmm<float>(ptr<int32_t>(crow), ptr<int32_t>(col), ptr<float>(vals), ptr<float>(xt),
                                   ptr<float>(b), ptr<int32_t>(order), yt.data_ptr<float>(),
                                   static_cast<int>(rows), static_cast<int>(n), stream);
  else
    err = cuda::launch_spmm<__nv_bfloat16>(
        ptr<int32_t>(crow), ptr<int32_t>(col), ptr<__nv_bfloat16>(vals), ptr<__nv_bfloat16>(xt),
        ptr<__nv_bfloat16>(b), ptr<int32_t>(order), reinterpret_cast<__nv_bfloat16*>(yt.data_ptr()),
        static_cast<int>(rows), static_cast<int>(n), stream);
  TORCH_CHECK(err == cudaSuccess, "ldsparse.spmm launch failed: ", cudaGetErrorString(err));
  return yt.t().contiguous();
}

at::Tensor sddmm_cuda(const at::Tensor& crow_in, const at::Tensor& col_in, const at::Tensor& g,
                      const at::Tensor& x) {
  check_sddmm(crow_in, col_in, g, x);
  check_cuda(x, "ldsparse.sddmm");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto crow = crow_in.contiguous(), col = col_in.contiguous();
  const int64_t rows = crow.numel() - 1, n = x.size(0);
  if (col.numel() == 0 || n == 0) return at::zeros({col.numel()}, x.options());
  const auto gt = g.t().contiguous(), xt = x.t().contiguous();
  auto out = at::empty({col.numel()}, x.options());
  const auto order = row_swizzle(crow);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (x.scalar_type() == at::kFloat)
    err = cuda::launch_sddmm<float>(ptr<int32_t>(crow), ptr<int32_t>(col), ptr<float>(gt), ptr<float>(xt),
                                    ptr<int32_t>(order), out.data_ptr<float>(), static_cast<int>(rows),
                                    static_cast<int>(n), stream);
  else
    err = cuda::launch_sddmm<__nv_bfloat16>(
        ptr<int32_t>(crow), ptr<int32_t>(col), ptr<__nv_bfloat16>(gt), ptr<__nv_bfloat16>(xt),
        ptr<int32_t>(order), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), static_cast<int>(rows),
        static_cast<int>(n), stream);
  TORCH_CHECK(err == cudaSuccess, "ldsparse.sddmm launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace
}  // namespace ldsparse

TORCH_LIBRARY_IMPL(ldsparse, CUDA, m) {
  m.impl("spmm", &ldsparse::spmm_cuda);
  m.impl("sddmm", &ldsparse::sddmm_cuda);
}
