// Host-side entry points of the CUDA kernels, free of CUDA device code and of torch: the torch
// bindings (*_binding.cpp, compiled by the host compiler) include this header, the kernels'
// translation units (*.cu, compiled by nvcc, which never sees torch headers) define it.  Why the
// split: nvcc compiling ATen headers was most of the extension's build time.
// The sparse-linear entry points take `Dtype` and untyped pointers; the attention ones take the
// parameter structs of attention_params.h (host-compilable, as is cuda_bf16.h).
#pragma once
#include <cuda_runtime_api.h>

#include <cuda_bf16.h>

#include <cstdint>

#include "attention_params.h"

namespace ldsparse {
namespace cuda {

enum class Dtype { f32, bf16 };

// ---- sparse linear (sparse_kernels.cu)
int spmm_chunk_count(int64_t in_features);
// chunk_ptr: int32 [(spmm_chunk_count(K) + 1) * rows], filled from the CSR pattern.
cudaError_t spmm_build_chunk_ptr(const int32_t* crow, const int32_t* col, int32_t* chunk_ptr, int rows,
                                 int chunks, cudaStream_t stream);
// y [n, rows] = x [n, K] W^T + bias, W = CSR(values, col) with chunk_ptr from above; K >= 1.
// staged: the v2 kernel (fp32 only; sparse_kernels.cuh says why), else v1.
cudaError_t spmm(Dtype dtype, const int32_t* chunk_ptr, const int32_t* col, const void* values, const void* x,
                 const void* bias, void* y, int rows, int K, int n, int chunks, bool staged, cudaStream_t stream);
// v3-v5, the entry-stream kernels (fp32; sparse_kernels.cuh says why), `variant` 3, 4 or 5 (their
// tile geometries).  Plan, per call: scan = int32 [spmm_stream_scan_size(rows, chunks, variant)],
// the exclusive prefix of the per-(row tile, chunk, row) entry counts in that order (rows padded
// to spmm_stream_tile_rows(variant) with zero counts); stream = int32 pairs [nnz][2] filled by
// spmm_stream_scatter from chunk_ptr.
int spmm_stream_tile_rows(int variant);
int64_t spmm_stream_scan_size(int rows, int chunks, int variant);
cudaError_t spmm_stream_scatter(const int32_t* chunk_ptr, const int32_t* col, const float* values,
                                const int32_t* scan, int32_t* stream, int rows, int chunks, int variant,
                                cudaStream_t cuda_stream);
cudaError_t spmm_stream(const int32_t* scan, const int32_t* stream, const float* x, const float* bias, float* y,
                        int rows, int K, int n, int chunks, int variant, cudaStream_t cuda_stream);
// out[p] = dense[row(p) * K + col[p]].
cudaError_t csr_gather(Dtype dtype, const int32_t* crow, const int32_t* col, const void* dense, void* out,
                       int rows, int K, cudaStream_t stream);

// ---- block-sparse attention (attention_{fwd,bwd}_{f32,bf16}.cu: one translation unit per
// direction and dtype, so the build compiles them in parallel)
cudaError_t attn_fwd(const attn::FwdParams<float>& p, int heads, cudaStream_t stream);
cudaError_t attn_fwd(const attn::FwdParams<__nv_bfloat16>& p, int heads, cudaStream_t stream);
cudaError_t attn_bwd(const attn::BwdParams<float>& p, int heads, float* dq, cudaStream_t stream);
cudaError_t attn_bwd(const attn::BwdParams<__nv_bfloat16>& p, int heads, __nv_bfloat16* dq, cudaStream_t stream);

}  // namespace cuda
}  // namespace ldsparse
