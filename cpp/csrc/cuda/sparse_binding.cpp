// Torch binding of the sparse-linear CUDA kernels (compiled by the host compiler; the kernels
// are in sparse_kernels.cu).  Inputs are checked as on the CPU (sparse_checks.h); the CSR
// contents are trusted on the GPU (reading them would sync and break CUDA-graph capture), and
// SparseLinear builds valid patterns (columns sorted within each row).
//
//   spmm:  fp32: the entry-stream kernel v5 (sparse_kernels.cuh), its plan built per call from
//          the CSR (row starts per column chunk by a binary-search kernel, a prefix sum, a scatter;
//          no sort); bf16: the tiled kernel v1.  Both on token-major x and y (no transposes).
//          LDSPARSE_SPMM_KERNEL=v1..v5 picks another fp32 kernel.
//   sddmm: the dense gradient g^T x on cuBLAS (tensor cores for bf16), gathered at the pattern.
//          One dense [rows, K] temporary; at the sparsities pruning reaches this beats any
//          SIMT SDDMM we measured, and it is exact (fp32 accumulation, one rounding).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "cuda/launchers.h"
#include "sparse_checks.h"

namespace ldsparse {
namespace {

namespace kc = cuda;

void check_cuda(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, " (CUDA): x must be on the GPU, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              " (CUDA): float32 or bfloat16 only, got ", x.scalar_type(),
              " (lightning_dynmo.sparse runs float16 upcast to float32)");
  check_fits_int(x.size(0), "tokens", op);
  check_fits_int(x.size(1), "in_features", op);
}

kc::Dtype dtype_of(const at::Tensor& x) { return x.scalar_type() == at::kFloat ? kc::Dtype::f32 : kc::Dtype::bf16; }

const void* ptr_or_null(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// LDSPARSE_SPMM_KERNEL picks the fp32 SpMM kernel (read per call, so one process can time them
// side by side): v1 (tiled), v2 (staged), v3-v5 (entry stream in three tile shapes).  Unset: v5,
// the fastest at every sparsity from 70 % on an H200 (benchmarks/results/2026-11-28-gpu.md).
// bf16 always runs v1.
constexpr int kDefaultKernel = 5;
int selected_kernel() {
  const char* v = std::getenv("LDSPARSE_SPMM_KERNEL");
  const std::string name = v == nullptr ? "" : v;
  TORCH_CHECK(name.empty() || name == "v1" || name == "v2" || name == "v3" || name == "v4" || name == "v5",
              "LDSPARSE_SPMM_KERNEL must be one of v1, v2, v3, v4, v5 (or unset: v5), got '", name, "'");
  return name.empty() ? kDefaultKernel : name[1] - '0';
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
}

// v3: lay the non-zeros out as the entry stream (per call: the pattern's counts per row tile,
// chunk and row, their prefix, and one scatter), then run the stream kernel.
void spmm_stream_cuda(const at::Tensor& chunk_ptr, const at::Tensor& col, const at::Tensor& vals, const at::Tensor& x,
                      const c10::optional<at::Tensor>& bias, at::Tensor& y, int chunks, int variant) {
  const char* op = "ldsparse.spmm (entry stream)";
  const int64_t rows = y.size(1), n = x.size(0), K = x.size(1);
  const int64_t tile = kc::spmm_stream_tile_rows(variant);
  const int64_t padded = (rows + tile - 1) / tile * tile;
  const auto starts = chunk_ptr.view({chunks + 1, rows});
  auto counts = starts.narrow(0, 1, chunks) - starts.narrow(0, 0, chunks);  // [chunks, rows]
  if (padded != rows) counts = at::constant_pad_nd(counts, {0, padded - rows});
  counts = counts.view({chunks, padded / tile, tile}).permute({1, 0, 2}).reshape({-1});
  const int64_t slots = kc::spmm_stream_scan_size(static_cast<int>(rows), chunks, variant);
  TORCH_CHECK(slots == counts.numel() + 1, op, ": internal plan size mismatch");
  auto scan = at::zeros({slots}, chunk_ptr.options());
  scan.narrow(0, 1, slots - 1).copy_(at::cumsum(counts, 0, at::kInt));
  auto stream_entries = at::empty({col.numel(), 2}, chunk_ptr.options());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  check_launch(kc::spmm_stream_scatter(chunk_ptr.data_ptr<int32_t>(), col.data_ptr<int32_t>(), vals.data_ptr<float>(),
                                       scan.data_ptr<int32_t>(), stream_entries.data_ptr<int32_t>(),
                                       static_cast<int>(rows), chunks, variant, stream), op);
  check_launch(kc::spmm_stream(scan.data_ptr<int32_t>(), stream_entries.data_ptr<int32_t>(), x.data_ptr<float>(),
                               bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                               static_cast<int>(rows), static_cast<int>(K), static_cast<int>(n), chunks, variant,
                               stream), op);
}

at::Tensor spmm_cuda(const at::Tensor& crow_in, const at::Tensor& col_in, const at::Tensor& values,
                     const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in) {
  const char* op = "ldsparse.spmm";
  check_spmm(crow_in, col_in, values, x_in, bias_in);
  check_cuda(x_in, op);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto crow = crow_in.contiguous(), col = col_in.contiguous(), vals = values.contiguous(),
             x = x_in.contiguous();
  const c10::optional<at::Tensor> bias =
      bias_in.has_value() ? c10::optional<at::Tensor>(bias_in->contiguous()) : c10::nullopt;
  const int64_t rows = crow.numel() - 1, n = x.size(0), K = x.size(1);
  if (K == 0)  // no columns: y = bias (the kernels need at least one column chunk)
    return bias.has_value() ? bias->unsqueeze(0).expand({n, rows}).contiguous() : at::zeros({n, rows}, x.options());
  auto y = at::empty({n, rows}, x.options());
  if (rows == 0 || n == 0) return y;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int chunks = kc::spmm_chunk_count(K);
  auto chunk_ptr = at::empty({(chunks + 1) * rows}, crow.options());
  check_launch(kc::spmm_build_chunk_ptr(crow.data_ptr<int32_t>(), col.data_ptr<int32_t>(),
                                        chunk_ptr.data_ptr<int32_t>(), static_cast<int>(rows), chunks, stream), op);
  const int kernel = x.scalar_type() == at::kFloat ? selected_kernel() : 1;
  if (kernel >= 3) {
    spmm_stream_cuda(chunk_ptr, col, vals, x, bias, y, chunks, kernel);
    return y;
  }
  check_launch(kc::spmm(dtype_of(x), chunk_ptr.data_ptr<int32_t>(), col.data_ptr<int32_t>(), vals.data_ptr(),
                        x.data_ptr(), ptr_or_null(bias), y.data_ptr(), static_cast<int>(rows), static_cast<int>(K),
                        static_cast<int>(n), chunks, kernel == 2, stream), op);
  return y;
}

at::Tensor sddmm_cuda(const at::Tensor& crow_in, const at::Tensor& col_in, const at::Tensor& g,
                      const at::Tensor& x) {
  const char* op = "ldsparse.sddmm";
  check_sddmm(crow_in, col_in, g, x);
  check_cuda(x, op);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto crow = crow_in.contiguous(), col = col_in.contiguous();
  const int64_t rows = crow.numel() - 1, K = x.size(1);
  auto out = at::empty({col.numel()}, x.options());
  if (col.numel() == 0) return out;
  const auto dense = at::mm(g.t(), x).contiguous();  // [rows, K]; zeros when there are no tokens
  check_launch(kc::csr_gather(dtype_of(x), crow.data_ptr<int32_t>(), col.data_ptr<int32_t>(), dense.data_ptr(),
                              out.data_ptr(), static_cast<int>(rows), static_cast<int>(K),
                              c10::cuda::getCurrentCUDAStream()), op);
  return out;
}

}  // namespace
}  // namespace ldsparse

TORCH_LIBRARY_IMPL(ldsparse, CUDA, m) {
  m.impl("spmm", &ldsparse::spmm_cuda);
  m.impl("sddmm", &ldsparse::sddmm_cuda);
}
