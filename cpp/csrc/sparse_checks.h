// Input checks of the spmm/sddmm ops, shared by the CPU (sparse_cpu.cpp) and CUDA
// (cuda/sparse_binding.cpp) bindings so both devices reject the same bad input with the same
// message, instead of the GPU reading out of bounds where the CPU would have refused.
// Only metadata is checked (shapes, dtypes, devices, int32 limits): nothing here reads device
// memory, so the CUDA op stays sync-free and CUDA-graph capturable.
#pragma once
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>

#include "check_format.h"

namespace ldsparse {

// `value` (a count the kernels index with int32) must fit an int.
inline void check_fits_int(int64_t value, const char* what, const char* op) {
  TORCH_CHECK(value <= INT_MAX, op, ": ", what, " = ", num(value), " exceeds the kernels' int32 limit (",
              num(INT_MAX), "); split the input into smaller pieces");
}

// `t` must sit on `ref`'s device: the op is dispatched on one device and reads every input there.
inline void check_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                         const char* ref_name, const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; move all inputs to one device");
}

// CSR pattern: 1-D int32 crow_indices (rows + 1) and col_indices (nnz) on one device.
inline void check_csr(const at::Tensor& crow, const at::Tensor& col, const char* op) {
  TORCH_CHECK(crow.scalar_type() == at::kInt && col.scalar_type() == at::kInt, op,
              ": crow_indices/col_indices must be int32, got ", crow.scalar_type(), "/",
              col.scalar_type(), " (csr_pattern() builds them)");
  TORCH_CHECK(crow.dim() == 1 && crow.numel() >= 1, op,
              ": crow_indices must be 1-D with rows + 1 entries, got shape ", shape(crow.sizes()));
  TORCH_CHECK(col.dim() == 1, op, ": col_indices must be 1-D, got shape ", shape(col.sizes()));
  check_device(col, "col_indices", crow, "crow_indices", op);
  check_fits_int(crow.numel() - 1, "rows", op);
  check_fits_int(col.numel(), "non-zeros", op);
}

// y[t, r] = bias[r] + sum_k W[r, k] x[t, k]: values one per non-zero, bias one per row.
inline void check_spmm(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& values,
                       const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  const char* op = "ldsparse.spmm";
  check_csr(crow, col, op);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [tokens, in_features], got shape ", shape(x.sizes()));
  TORCH_CHECK(values.dim() == 1 && values.numel() == col.numel(), op,
              ": values must be 1-D with one entry per non-zero (", num(col.numel()),
              " col_indices), got shape ", shape(values.sizes()));
  TORCH_CHECK(values.scalar_type() == x.scalar_type(), op, ": values dtype ", values.scalar_type(),
              " differs from x dtype ", x.scalar_type(), "; cast both to one dtype");
  check_device(crow, "crow_indices", x, "x", op);
  check_device(values, "values", x, "x", op);
  if (bias.has_value()) {
    const auto rows = crow.numel() - 1;
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == rows, op, ": bias must be 1-D with one entry per "
                "output row (", num(rows), "), got shape ", shape(bias->sizes()));
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), op, ": bias dtype ", bias->scalar_type(),
                " differs from x dtype ", x.scalar_type(), "; cast both to one dtype");
    check_device(*bias, "bias", x, "x", op);
  }
}

// out[j] = sum_t g[t, row(j)] x[t, col(j)]: g is [tokens, rows], x is [tokens, in_features].
inline void check_sddmm(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& g,
                        const at::Tensor& x) {
  const char* op = "ldsparse.sddmm";
  check_csr(crow, col, op);
  TORCH_CHECK(g.dim() == 2 && x.dim() == 2, op, ": g [tokens, rows] and x [tokens, in_features] "
              "must be 2-D, got shapes ", shape(g.sizes()), " and ", shape(x.sizes()));
  TORCH_CHECK(g.size(0) == x.size(0), op, ": g has ", num(g.size(0)), " tokens but x has ", num(x.size(0)));
  TORCH_CHECK(g.size(1) == crow.numel() - 1, op, ": g has ", num(g.size(1)),
              " columns but the pattern has ", num(crow.numel() - 1), " rows");
  TORCH_CHECK(g.scalar_type() == x.scalar_type(), op, ": g dtype ", g.scalar_type(),
              " differs from x dtype ", x.scalar_type(), "; cast both to one dtype");
  check_device(crow, "crow_indices", x, "x", op);
  check_device(g, "g", x, "x", op);
}

}  // namespace ldsparse
