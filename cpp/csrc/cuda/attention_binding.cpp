// Torch binding of the block-sparse attention CUDA kernels (attention_kernels.cuh, compiled in
// attention_{fwd,bwd}_{f32,bf16}.cu), fp32 and bf16; compiled by the host compiler.  Checks shapes and dtypes (the layout's contents are trusted on the GPU: validating
// them would need a device sync; the CPU op checks them, and lightning_dynmo builds layouts
// that are valid by construction).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "check_format.h"
#include "cuda/launchers.h"

namespace ldsparse {
namespace {

namespace ak = cuda::attn;

struct Shape {
  int64_t B, H, T, S, D, nblk;
};

Shape check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ptr,
            const at::Tensor& idx, int64_t bs, const c10::optional<at::Tensor>& slot_token, const char* op) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && ptr.is_cuda() && idx.is_cuda(), op,
              " (CUDA): all tensors must be on the GPU");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), op,
              ": q, k, v must be [batch, heads, seq, head_dim] of one shape");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": q, k, v must have the same dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op,
              " (CUDA): float32 or bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(bs == 16 || bs == 32 || bs == 64 || bs == 128, op, ": block_size must be 16, 32, 64 or 128, got ", num(bs));
  TORCH_CHECK(q.size(3) >= 1 && q.size(3) <= ak::kMaxHeadDim, op, " (CUDA): head_dim must be in [1, ",
              num(ak::kMaxHeadDim), "], got ", num(q.size(3)));
  Shape s{q.size(0), q.size(1), q.size(2), q.size(2), q.size(3), 0};
  if (slot_token.has_value()) {
    const auto& st = *slot_token;
    TORCH_CHECK(st.is_cuda() && st.scalar_type() == at::kInt && st.is_contiguous() && st.dim() == 3 &&
                st.size(0) == s.B && st.size(1) == s.H, op, ": slot_token must be a contiguous int32 [B, H, S] GPU tensor");
    s.S = st.size(2);
  }
  s.nblk = (s.S + bs - 1) / bs;
  TORCH_CHECK(ptr.scalar_type() == at::kInt && idx.scalar_type() == at::kInt, op, ": layout indices must be int32");
  TORCH_CHECK(ptr.dim() == 3 && ptr.size(0) == s.B && ptr.size(1) == s.H && ptr.size(2) == s.nblk + 1 &&
              ptr.is_contiguous() && idx.dim() == 1 && idx.is_contiguous(), op,
              ": layout must be contiguous, [B, H, ceil(S / block_size) + 1] offsets and 1-D indices");
  TORCH_CHECK(s.T < (int64_t(1) << 31) && s.S < (int64_t(1) << 31), op, ": sequence too long for int32 indices");
  return s;
}

at::Tensor rows_contiguous(const at::Tensor& x) { return x.size(3) == 1 || x.stride(3) == 1 ? x : x.contiguous(); }

template <typename T>
ak::Src<T> src_of(const at::Tensor& x) {
  return {reinterpret_cast<const T*>(x.data_ptr()), x.stride(0), x.stride(1), x.stride(2)};
}

ak::Geom geom(const Shape& s, int64_t bs, double scale, const c10::optional<at::Tensor>& slot_token) {
  return {slot_token.has_value() ? slot_token->data_ptr<int32_t>() : nullptr, static_cast<int>(s.H),
          static_cast<int>(s.T), static_cast<int>(s.S), static_cast<int>(s.D), static_cast<int>(bs),
          static_cast<int>(s.nblk), static_cast<float>(scale)};
}

template <typename T>
void fwd_typed(const Shape& s, const ak::Geom& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& row_ptr, const at::Tensor& col_idx, at::Tensor& out, at::Tensor& lse) {
  const ak::FwdParams<T> p{g, src_of<T>(q), src_of<T>(k), src_of<T>(v), row_ptr.data_ptr<int32_t>(),
                           col_idx.data_ptr<int32_t>(), reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>()};
  const cudaError_t err = cuda::attn_fwd(p, static_cast<int>(s.B * s.H), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ldsparse.block_attn_fwd launch failed: ", cudaGetErrorString(err));
}

template <typename T>
void bwd_typed(const Shape& s, const ak::Geom& g, const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& col_ptr,
               const at::Tensor& row_idx, at::Tensor& dq_acc, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const ak::BwdParams<T> p{g, src_of<T>(q), src_of<T>(k), src_of<T>(v), src_of<T>(grad),
                           col_ptr.data_ptr<int32_t>(), row_idx.data_ptr<int32_t>(), lse.data_ptr<float>(),
                           delta.data_ptr<float>(), reinterpret_cast<T*>(dk.data_ptr()),
                           reinterpret_cast<T*>(dv.data_ptr()), dq_acc.data_ptr<float>()};
  const cudaError_t err = cuda::attn_bwd(p, static_cast<int>(s.B * s.H), reinterpret_cast<T*>(dq.data_ptr()),
                                            c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ldsparse.block_attn_bwd launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> block_attn_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                       const at::Tensor& v_in, const at::Tensor& row_ptr,
                                                       const at::Tensor& col_idx, int64_t block_size, double scale,
                                                       const c10::optional<at::Tensor>& slot_token) {
  const Shape s = check(q_in, k_in, v_in, row_ptr, col_idx, block_size, slot_token, "ldsparse.block_attn_fwd");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  // Tokens without a slot would keep garbage: a valid slot_token maps every token (see the CPU op).
  auto out = at::empty({s.B, s.H, s.T, s.D}, q.options());
  auto lse = at::empty({s.B, s.H, s.S}, q.options().dtype(at::kFloat));
  const ak::Geom g = geom(s, block_size, scale, slot_token);
  if (q.scalar_type() == at::kFloat)
    fwd_typed<float>(s, g, q, k, v, row_ptr, col_idx, out, lse);
  else
    fwd_typed<__nv_bfloat16>(s, g, q, k, v, row_ptr, col_idx, out, lse);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_attn_bwd_cuda(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out, const at::Tensor& lse_in, const at::Tensor& col_ptr, const at::Tensor& row_idx,
    int64_t block_size, double scale, const c10::optional<at::Tensor>& slot_token) {
  const Shape s = check(q_in, k_in, v_in, col_ptr, row_idx, block_size, slot_token, "ldsparse.block_attn_bwd");
  TORCH_CHECK(grad_in.sizes() == q_in.sizes() && out.sizes() == q_in.sizes(), "ldsparse.block_attn_bwd: grad_out and out must have q's shape");
  TORCH_CHECK(lse_in.dim() == 3 && lse_in.size(2) == s.S && lse_in.scalar_type() == at::kFloat,
              "ldsparse.block_attn_bwd: lse must be float32 [B, H, S]");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in),
             grad = rows_contiguous(grad_in), lse = lse_in.contiguous();
  const auto delta = (grad.to(at::kFloat) * out.to(at::kFloat)).sum(-1).contiguous();  // [B, H, T]
  auto dq_acc = at::zeros({s.B, s.H, s.S, s.D}, q.options().dtype(at::kFloat));
  auto dq = at::empty({s.B, s.H, s.T, s.D}, q.options());
  auto dk = at::empty({s.B, s.H, s.T, s.D}, q.options());
  auto dv = at::empty({s.B, s.H, s.T, s.D}, q.options());
  const ak::Geom g = geom(s, block_size, scale, slot_token);
  if (q.scalar_type() == at::kFloat)
    bwd_typed<float>(s, g, grad, q, k, v, lse, delta, col_ptr, row_idx, dq_acc, dq, dk, dv);
  else
    bwd_typed<__nv_bfloat16>(s, g, grad, q, k, v, lse, delta, col_ptr, row_idx, dq_acc, dq, dk, dv);
  return {dq, dk, dv};
}

}  // namespace
}  // namespace ldsparse

TORCH_LIBRARY_IMPL(ldsparse, CUDA, m) {
  m.impl("block_attn_fwd", &ldsparse::block_attn_fwd_cuda);
  m.impl("block_attn_bwd", &ldsparse::block_attn_bwd_cuda);
}
