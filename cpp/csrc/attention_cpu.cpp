// Block-sparse causal attention: op schemas and the CPU driver (OpenMP around the per-ISA
// kernels of attention_kernels.h).
//
// Layout format (one CSR per (batch, head), heads stored one after another):
//   row_ptr int32 [B, H, nblk + 1], col_idx int32 [nnz], nblk = ceil(S / block_size);
//   the key blocks of query block i of head (b, h) are col_idx[row_ptr[b,h,i] : row_ptr[b,h,i+1]],
//   strictly increasing and <= i (causal), and row_ptr[b,h,0] is the previous head's end
//   (so the whole layout is one CSR over B*H*nblk rows).  Inside the diagonal block keys after
//   the query are masked; the last block may be ragged (S need not divide by block_size).
//   A query block with no key block outputs 0 (lse = -inf), as SDPA does for masked-out rows.
// The backward takes the transposed layout (same format, per key block the query blocks that
// attend to it, each >= the key block), built by lightning_dynmo.sparse.attention.
//
// Slots.  The layout is defined on S "slots"; by default slot s is token s (S = T).  An
// optional slot_token int32 [B, H, S] maps each slot to a token (-1: an empty padding slot:
// no key, and its output is dropped); every token must have exactly one slot.  Packing reads q/k/v through it and
// outputs and gradients are written straight to token order, so a permuted sequence (the
// hash-sorted one of lightning_dynmo.sparse.hash_layout) costs no gather/scatter passes.
//
// One OpenMP region per call, phases separated by the work-sharing barriers:
//   1. pack (per (batch, head, block)): operands into the vector-padded layouts of
//      attention_dispatch.h (rows padded to whole vectors; K^T, V^T as one [D][BS] panel per
//      block), straight from the strided inputs, scale folded into Qs;
//   2. compute.  Forward: one item per (batch, head, query block), dynamically scheduled in
//      order of decreasing row length (Sputnik's row swizzle: the longest rows start first).
//      Backward: items are (batch, head, chunk of key blocks), chunks balanced by block pairs;
//      an item writes dK/dV of its key blocks and accumulates dQ into a buffer private to its
//      chunk (no atomics); chunks per head are 1 once batch * heads fills the threads;
//   3. (backward) dQ = scale * sum of the chunk buffers, in a fixed order: deterministic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "attention_dispatch.h"
#include "check_format.h"
#include "cpu_dispatch.h"

TORCH_LIBRARY_FRAGMENT(ldsparse, m) {
  // out = softmax(q k^T * scale + mask) v over a causal block layout; lse = log-sum-exp of
  // each slot's scores (for the backward), [B, H, S].  q, k, v, out: [B, H, T, D].
  m.def("block_attn_fwd(Tensor q, Tensor k, Tensor v, Tensor row_ptr, Tensor col_idx, "
        "int block_size, float scale, Tensor? slot_token=None) -> (Tensor out, Tensor lse)");
  // Gradients of block_attn_fwd's out; (col_ptr, row_idx) is the transposed layout.
  m.def("block_attn_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor col_ptr, Tensor row_idx, int block_size, float scale, Tensor? slot_token=None) -> "
        "(Tensor dq, Tensor dk, Tensor dv)");
}

namespace ldsparse {
namespace {

const AttnKernels<float>& attn_kernels(float) {
  const char* isa = selected_isa();
  if (!std::strcmp(isa, "avx512")) return isa_avx512::attn_kernels_f32();
  if (!std::strcmp(isa, "avx2")) return isa_avx2::attn_kernels_f32();
  return isa_default::attn_kernels_f32();
}
const AttnKernels<double>& attn_kernels(double) {
  const char* isa = selected_isa();
  if (!std::strcmp(isa, "avx512")) return isa_avx512::attn_kernels_f64();
  if (!std::strcmp(isa, "avx2")) return isa_avx2::attn_kernels_f64();
  return isa_default::attn_kernels_f64();
}

struct Geometry {
  int64_t B, H, T, S, D, bs, nblk, Spad, Dp;
  int bi;  // index into kAttnBlocks
  int64_t heads() const { return B * H; }
};

Geometry check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t bs,
                      const c10::optional<at::Tensor>& slot_token, const char* op) {
  TORCH_CHECK(q.dim() == 4, op, ": q, k, v must be [batch, heads, seq, head_dim], got q of shape ",
              shape(q.sizes()));
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), op,
              ": q, k, v must have the same shape, got ", shape(q.sizes()), ", ", shape(k.sizes()), ", ",
              shape(v.sizes()));
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": q, k, v must have the same dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, op,
              " (CPU): float32 or float64 only, got ", q.scalar_type());
  Geometry g{q.size(0), q.size(1), q.size(2), q.size(2), q.size(3), bs, 0, 0, 0, -1};
  for (int i = 0; i < kNumAttnBlocks; ++i)
    if (kAttnBlocks[i] == bs) g.bi = i;
  TORCH_CHECK(g.bi >= 0, op, ": block_size must be 16, 32, 64 or 128, got ", num(bs));
  TORCH_CHECK(g.D >= 1, op, ": head_dim must be positive");
  if (slot_token.has_value()) {
    const auto& st = *slot_token;
    TORCH_CHECK(st.scalar_type() == at::kInt, op, ": slot_token must be int32, got ", st.scalar_type());
    TORCH_CHECK(st.dim() == 3 && st.size(0) == g.B && st.size(1) == g.H, op,
                ": slot_token must be [B, H, slots] = [", num(g.B), ", ", num(g.H), ", S], got ",
                shape(st.sizes()));
    TORCH_CHECK(st.device().is_cpu() && st.is_contiguous(), op, ": slot_token must be contiguous on the CPU");
    g.S = st.size(2);
    // Every token exactly once per head, other slots -1: outputs are then fully written.
    const int32_t* p = st.data_ptr<int32_t>();
    std::vector<uint8_t> seen(static_cast<size_t>(g.T));
    for (int64_t bh = 0; bh < g.heads(); ++bh) {
      std::fill(seen.begin(), seen.end(), uint8_t(0));
      int64_t mapped = 0;
      for (int64_t s = 0; s < g.S; ++s) {
        const int64_t t = p[bh * g.S + s];
        TORCH_CHECK(t >= -1 && t < g.T, op, ": slot_token values must be -1 or a token in [0, ", num(g.T),
                    "), got ", num(t));
        if (t < 0) continue;
        TORCH_CHECK(!seen[t], op, ": token ", num(t), " has two slots in head ", num(bh));
        seen[t] = 1;
        ++mapped;
      }
      TORCH_CHECK(mapped == g.T, op, ": every token needs a slot; head ", num(bh), " maps ", num(mapped), " of ",
                num(g.T));
    }
  }
  g.nblk = (g.S + bs - 1) / bs;
  g.Spad = g.nblk * bs;
  const int64_t lanes = 64 / static_cast<int64_t>(q.element_size());
  g.Dp = (g.D + lanes - 1) / lanes * lanes;
  return g;
}

// The layout contract above, checked in O(nnz): a bad layout must raise, never read out of
// bounds.  `transposed`: per key block the query blocks (indices >= the block, not <=).
void check_layout(const at::Tensor& ptr, const at::Tensor& idx, const Geometry& g, bool transposed,
                  const char* op) {
  const char* pn = transposed ? "col_ptr" : "row_ptr";
  const char* in = transposed ? "row_idx" : "col_idx";
  TORCH_CHECK(ptr.scalar_type() == at::kInt && idx.scalar_type() == at::kInt, op, ": ", pn, " and ",
              in, " must be int32, got ", ptr.scalar_type(), " and ", idx.scalar_type());
  TORCH_CHECK(ptr.dim() == 3 && ptr.size(0) == g.B && ptr.size(1) == g.H && ptr.size(2) == g.nblk + 1,
              op, ": ", pn, " must have shape [B, H, ceil(S / block_size) + 1] = [", num(g.B), ", ",
              num(g.H), ", ", num(g.nblk + 1), "] (S = ", num(g.S), " slots), got ", shape(ptr.sizes()));
  TORCH_CHECK(idx.dim() == 1, op, ": ", in, " must be 1-D, got shape ", shape(idx.sizes()));
  TORCH_CHECK(ptr.device().is_cpu() && idx.device().is_cpu(), op, ": layout must be on the CPU");
  TORCH_CHECK(ptr.is_contiguous() && idx.is_contiguous(), op, ": layout tensors must be contiguous");
  const int32_t* p = ptr.data_ptr<int32_t>();
  const int32_t* ix = idx.data_ptr<int32_t>();
  const int64_t nnz = idx.numel(), n = g.nblk;
  int64_t end = 0;
  for (int64_t bh = 0; bh < g.heads(); ++bh) {
    const int32_t* pp = p + bh * (n + 1);
    TORCH_CHECK(pp[0] == end, op, ": ", pn, "[b, h, 0] must equal the previous head's last offset (",
                num(end), "; heads are stored one after another), got ", num(pp[0]), " at head ", num(bh));
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(pp[r] <= pp[r + 1] && pp[r + 1] <= nnz, op, ": ", pn,
                  " must be non-decreasing and at most ", in, ".numel() = ", num(nnz));
      int64_t prev = -1;
      for (int64_t e = pp[r]; e < pp[r + 1]; ++e) {
        const int64_t c = ix[e];
        TORCH_CHECK(c > prev, op, ": ", in, " must be strictly increasing within a block row");
        TORCH_CHECK(c >= 0 && c < n && (transposed ? c >= r : c <= r), op,
                    ": layout is not causal or out of range: block (", num(transposed ? c : r), ", ",
                    num(transposed ? r : c), ") of head ", num(bh),
                    " (query block, key block) needs key <= query < ", num(n));
        prev = c;
      }
    }
    end = pp[n];
  }
  TORCH_CHECK(end == nnz, op, ": the last offset of ", pn, " (", num(end), ") must equal ", in,
              ".numel() (", num(nnz), ")");
}

struct Scratch {  // 64-byte aligned per-thread buffer
  explicit Scratch(size_t bytes)
      : p(static_cast<char*>(std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64)))) {}
  ~Scratch() { std::free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T> T* as() { return reinterpret_cast<T*>(p); }
  char* p;
};

// A [B, H, T, D] input read in place: any strides, rows of D contiguous elements.
template <typename T>
struct Rows {
  const T* p;
  int64_t sb, sh, st;
  const T* row(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};
at::Tensor rows_contiguous(const at::Tensor& x) { return x.size(3) == 1 || x.stride(3) == 1 ? x : x.contiguous(); }
template <typename T>
Rows<T> rows_of(const at::Tensor& x) { return {x.data_ptr<T>(), x.stride(0), x.stride(1), x.stride(2)}; }

// The packed operands of a call live in a workspace of the calling thread that later calls
// reuse (grown, never shrunk): fresh multi-megabyte buffers come from mmap, and their page
// faults were measured at ~1 ms per 4 MB on every call, as much as the kernels at low density.
// Workspaces above LDSPARSE_ATTN_WORKSPACE_MB (default 1024) are not kept.
class Workspace {
 public:
  explicit Workspace(const std::vector<size_t>& bytes) {
    size_t total = 0;
    for (size_t b : bytes) offsets_.push_back(total), total += (b + 63) / 64 * 64;
    static const size_t keep = [] {
      const char* env = std::getenv("LDSPARSE_ATTN_WORKSPACE_MB");
      return static_cast<size_t>(env ? std::atoll(env) : 1024) << 20;
    }();
    Cached& cached = cache();
    if (total <= keep) {
      if (total > cached.bytes) {
        std::free(cached.p);
        cached.p = allocate(total);
        cached.bytes = total;
      }
      base_ = cached.p;
    } else {
      base_ = own_ = allocate(total);
    }
  }
  ~Workspace() { std::free(own_); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  template <typename T> T* get(size_t i) const { return reinterpret_cast<T*>(base_ + offsets_[i]); }

 private:
  struct Cached {
    char* p = nullptr;
    size_t bytes = 0;
    ~Cached() { std::free(p); }
  };
  static Cached& cache() {
    thread_local Cached c;
    return c;
  }
  static char* allocate(size_t bytes) {
    char* p = static_cast<char*>(std::aligned_alloc(64, std::max<size_t>(64, bytes)));
    TORCH_CHECK(p != nullptr, "ldsparse: cannot allocate ", num(bytes), " bytes of attention workspace");
    return p;
  }
  std::vector<size_t> offsets_;
  char* base_ = nullptr;
  char* own_ = nullptr;
};

// Token rows of slots [blk * bs, +bs) of head bh (null: padding slot or past the end).
template <typename T>
void block_rows(const Rows<T>& x, const Geometry& g, const AttnGeom& ag, int64_t bh, int64_t blk,
                const T** rows) {
  const int64_t b = bh / g.H, h = bh % g.H;
  for (int64_t r = 0; r < g.bs; ++r) {
    const int64_t s = blk * g.bs + r, tok = s < g.S ? ag.token(bh, s) : -1;
    rows[r] = tok >= 0 ? x.row(b, h, tok) : nullptr;
  }
}

// Those rows into rows of `dst` ([BH][Spad][Dp]), times scale; padding slots and lanes zero.
template <typename T>
void pack_rows(const Geometry& g, const T* const* rows, int64_t bh, int64_t blk, T scale, T* dst) {
  for (int64_t r = 0; r < g.bs; ++r) {
    T* d = dst + (bh * g.Spad + blk * g.bs + r) * g.Dp;
    int64_t f = 0;
    if (rows[r])
      for (; f < g.D; ++f) d[f] = rows[r][f] * scale;
    for (; f < g.Dp; ++f) d[f] = T(0);
  }
}

// The same rows transposed into the block's panel of `dst` ([BH][nblk][D][bs]).  Feature-outer
// order: each store strip is contiguous and the gathered loads hit the bs source rows, which
// stay in L1.
template <typename T>
void pack_cols(const Geometry& g, const T* const* rows, int64_t bh, int64_t blk, T* dst) {
  T* panel = dst + (bh * g.nblk + blk) * g.D * g.bs;
  for (int64_t f = 0; f < g.D; ++f) {
    T* d = panel + f * g.bs;
    for (int64_t r = 0; r < g.bs; ++r) d[r] = rows[r] ? rows[r][f] : T(0);
  }
}

// 0 for the block's slots that hold a token, -infinity for padding slots (no keys).
template <typename T>
void key_bias(const Geometry& g, const T* const* rows, int64_t bh, int64_t blk, T* dst) {
  for (int64_t r = 0; r < g.bs; ++r)
    dst[bh * g.Spad + blk * g.bs + r] = rows[r] ? T(0) : -std::numeric_limits<T>::infinity();
}

constexpr int kMaxBlock = 128;

int threads_for(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
}

template <typename T>
void fwd_typed(const Geometry& g, const AttnGeom& ag, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& row_ptr, const at::Tensor& col_idx, double scale,
               at::Tensor& out, at::Tensor& lse) {
  const auto& kern = attn_kernels(T());
  const int64_t n = g.nblk, heads = g.heads();
  const size_t rows_bytes = sizeof(T) * heads * g.Spad * g.Dp, cols_bytes = sizeof(T) * heads * g.Spad * g.D;
  const bool padded = ag.slot_token != nullptr;
  const Workspace ws({rows_bytes, cols_bytes, rows_bytes, padded ? sizeof(T) * heads * g.Spad : 0});
  const AttnFwdArgs<T> args{ag, ws.get<T>(0), ws.get<T>(1), ws.get<T>(2), out.data_ptr<T>(), lse.data_ptr<T>(),
                            padded ? ws.get<T>(3) : nullptr};
  const Rows<T> qx = rows_of<T>(q), kx = rows_of<T>(k), vx = rows_of<T>(v);
  const int32_t* rp = row_ptr.data_ptr<int32_t>();
  const int32_t* ci = col_idx.data_ptr<int32_t>();
  const int64_t items = heads * n;
  auto start = [&](int64_t item) { return rp[item / n * (n + 1) + item % n]; };
  auto length = [&](int64_t item) { return rp[item / n * (n + 1) + item % n + 1] - start(item); };
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return length(a) > length(b); });
#pragma omp parallel num_threads(threads_for(items))
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t bh = it / n, blk = it % n;
      const T* rows[kMaxBlock];
      block_rows(qx, g, ag, bh, blk, rows);
      pack_rows(g, rows, bh, blk, T(scale), const_cast<T*>(args.qs));
      block_rows(kx, g, ag, bh, blk, rows);
      pack_cols(g, rows, bh, blk, const_cast<T*>(args.kt));
      if (args.kbias) key_bias(g, rows, bh, blk, const_cast<T*>(args.kbias));
      block_rows(vx, g, ag, bh, blk, rows);
      pack_rows(g, rows, bh, blk, T(1), const_cast<T*>(args.vp));
    }
    Scratch scratch(sizeof(T) * attn_fwd_scratch(g.bs, g.Dp));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t item = order[it];
      kern.fwd[g.bi](args, item / n, item % n, ci + start(item), length(item), scratch.as<T>());
    }
  }
}

// First key block of chunk c of a head whose transposed-layout offsets are cp[0..n]: chunks
// hold equal shares of (block pairs + one unit per key block, for its dK/dV write).
int64_t chunk_bound(const int32_t* cp, int64_t n, int64_t c, int64_t chunks) {
  if (c <= 0) return 0;
  if (c >= chunks) return n;
  const int64_t total = static_cast<int64_t>(cp[n] - cp[0]) + n, target = total * c / chunks;
  int64_t lo = 0, hi = n;  // smallest kb with cp[kb] - cp[0] + kb >= target
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(cp[mid] - cp[0]) + mid >= target) hi = mid; else lo = mid + 1;
  }
  return lo;
}

template <typename T>
void bwd_typed(const Geometry& g, const AttnGeom& ag, const at::Tensor& grad_out, const at::Tensor& q,
               const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
               const at::Tensor& col_ptr, const at::Tensor& row_idx, double scale, at::Tensor& dq,
               at::Tensor& dk, at::Tensor& dv) {
  const auto& kern = attn_kernels(T());
  const int64_t n = g.nblk, heads = g.heads(), threads = at::get_num_threads();
  const int64_t chunks = threads <= 1 || heads >= 2 * threads
                             ? 1 : std::min<int64_t>(n, (4 * threads + heads - 1) / heads);
  const int64_t rows_elems = heads * g.Spad * g.Dp, cols_elems = heads * g.Spad * g.D;
  const size_t rb = sizeof(T) * rows_elems, cb = sizeof(T) * cols_elems;
  const bool padded = ag.slot_token != nullptr;
  const Workspace ws({rb, cb, cb, rb, rb, sizeof(T) * heads * g.S, chunks * rb,
                      padded ? sizeof(T) * heads * g.Spad : 0});
  const AttnBwdArgs<T> args{ag, ws.get<T>(0), ws.get<T>(1), ws.get<T>(2), ws.get<T>(3), ws.get<T>(4),
                            lse.data_ptr<T>(), ws.get<T>(5), dk.data_ptr<T>(), dv.data_ptr<T>(),
                            padded ? ws.get<T>(7) : nullptr};
  const Rows<T> qx = rows_of<T>(q), kx = rows_of<T>(k), vx = rows_of<T>(v), gx = rows_of<T>(grad_out),
                ox = rows_of<T>(out);
  T* part = ws.get<T>(6);
  T* del = ws.get<T>(5);
  T* dqp = dq.data_ptr<T>();
  const int32_t* cp = col_ptr.data_ptr<int32_t>();
  const int32_t* ri = row_idx.data_ptr<int32_t>();
  const int64_t blocks = heads * n, items = heads * chunks;
#pragma omp parallel num_threads(threads_for(std::max(blocks, items)))
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < blocks; ++it) {  // 1. pack, delta = rowsum(dO * O), zero dQ parts
      const int64_t bh = it / n, blk = it % n;
      const T* rows[kMaxBlock];
      const T* orows[kMaxBlock];
      block_rows(qx, g, ag, bh, blk, rows);
      pack_rows(g, rows, bh, blk, T(scale), const_cast<T*>(args.qs));
      block_rows(kx, g, ag, bh, blk, rows);
      pack_cols(g, rows, bh, blk, const_cast<T*>(args.kt));
      pack_rows(g, rows, bh, blk, T(1), const_cast<T*>(args.kp));
      if (args.kbias) key_bias(g, rows, bh, blk, const_cast<T*>(args.kbias));
      block_rows(vx, g, ag, bh, blk, rows);
      pack_cols(g, rows, bh, blk, const_cast<T*>(args.vt));
      block_rows(gx, g, ag, bh, blk, rows);
      pack_rows(g, rows, bh, blk, T(1), const_cast<T*>(args.dop));
      block_rows(ox, g, ag, bh, blk, orows);
      for (int64_t r = 0; r < g.bs && blk * g.bs + r < g.S; ++r) {
        T acc[4] = {T(0), T(0), T(0), T(0)};  // 4 chains: the sum is latency-bound otherwise
        if (rows[r]) {
          int64_t f = 0;
          for (; f + 3 < g.D; f += 4)
            for (int u = 0; u < 4; ++u) acc[u] += rows[r][f + u] * orows[r][f + u];
          for (; f < g.D; ++f) acc[0] += rows[r][f] * orows[r][f];
        }
        del[bh * g.S + blk * g.bs + r] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      }
      for (int64_t c = 0; c < chunks; ++c)
        std::memset(part + c * rows_elems + (bh * g.Spad + blk * g.bs) * g.Dp, 0, sizeof(T) * g.bs * g.Dp);
    }
    Scratch scratch(sizeof(T) * attn_bwd_scratch(g.bs, g.Dp));
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {  // 2. dK, dV; dQ into the chunk's part
      const int64_t bh = item / chunks, c = item % chunks;
      const int32_t* hp = cp + bh * (n + 1);
      T* dqc = part + c * rows_elems + bh * g.Spad * g.Dp;
      for (int64_t kb = chunk_bound(hp, n, c, chunks); kb < chunk_bound(hp, n, c + 1, chunks); ++kb)
        kern.bwd[g.bi](args, bh, kb, ri + hp[kb], hp[kb + 1] - hp[kb], dqc, scratch.as<T>());
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < blocks; ++it) {  // 3. dQ = scale * sum of parts, to token order
      const int64_t bh = it / n, blk = it % n;
      for (int64_t s = blk * g.bs; s < std::min((blk + 1) * g.bs, g.S); ++s) {
        const int64_t tok = ag.token(bh, s);
        if (tok < 0) continue;
        T* dst = dqp + (bh * g.T + tok) * g.D;
        const T* src = part + (bh * g.Spad + s) * g.Dp;
        for (int64_t f = 0; f < g.D; ++f) dst[f] = src[f];
        for (int64_t c = 1; c < chunks; ++c)
          for (int64_t f = 0; f < g.D; ++f) dst[f] += src[c * rows_elems + f];
        for (int64_t f = 0; f < g.D; ++f) dst[f] *= T(scale);
      }
    }
  }
}

AttnGeom attn_geom(const Geometry& g, const c10::optional<at::Tensor>& slot_token) {
  return AttnGeom{g.S, g.Spad, g.D, g.Dp, g.T,
                  slot_token.has_value() ? slot_token->data_ptr<int32_t>() : nullptr};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> block_attn_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                      const at::Tensor& v_in, const at::Tensor& row_ptr,
                                                      const at::Tensor& col_idx, int64_t block_size,
                                                      double scale,
                                                      const c10::optional<at::Tensor>& slot_token) {
  const char* op = "ldsparse.block_attn_fwd";
  const Geometry g = check_inputs(q_in, k_in, v_in, block_size, slot_token, op);
  check_layout(row_ptr, col_idx, g, /*transposed=*/false, op);
  auto out = at::empty({g.B, g.H, g.T, g.D}, q_in.options());
  auto lse = at::empty({g.B, g.H, g.S}, q_in.options());
  if (g.heads() == 0 || g.S == 0) return {out, lse};
  const auto q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const AttnGeom ag = attn_geom(g, slot_token);
  if (q.scalar_type() == at::kFloat)
    fwd_typed<float>(g, ag, q, k, v, row_ptr, col_idx, scale, out, lse);
  else
    fwd_typed<double>(g, ag, q, k, v, row_ptr, col_idx, scale, out, lse);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_attn_bwd_cpu(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& col_ptr,
    const at::Tensor& row_idx, int64_t block_size, double scale,
    const c10::optional<at::Tensor>& slot_token) {
  const char* op = "ldsparse.block_attn_bwd";
  const Geometry g = check_inputs(q_in, k_in, v_in, block_size, slot_token, op);
  check_layout(col_ptr, row_idx, g, /*transposed=*/true, op);
  TORCH_CHECK(grad_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(), op,
              ": grad_out and out must have q's shape");
  TORCH_CHECK(lse_in.dim() == 3 && lse_in.size(0) == g.B && lse_in.size(1) == g.H && lse_in.size(2) == g.S,
              op, ": lse must be [B, H, S] (S = ", num(g.S), " slots), got ", shape(lse_in.sizes()));
  TORCH_CHECK(grad_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type() &&
              lse_in.scalar_type() == q_in.scalar_type(), op, ": grad_out, out, lse must have q's dtype");
  auto dq = at::empty({g.B, g.H, g.T, g.D}, q_in.options());
  auto dk = at::empty({g.B, g.H, g.T, g.D}, q_in.options());
  auto dv = at::empty({g.B, g.H, g.T, g.D}, q_in.options());
  if (g.heads() == 0 || g.S == 0) return {dq, dk, dv};
  const auto q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in),
             grad = rows_contiguous(grad_in), out = rows_contiguous(out_in), lse = lse_in.contiguous();
  const AttnGeom ag = attn_geom(g, slot_token);
  if (q.scalar_type() == at::kFloat)
    bwd_typed<float>(g, ag, grad, q, k, v, out, lse, col_ptr, row_idx, scale, dq, dk, dv);
  else
    bwd_typed<double>(g, ag, grad, q, k, v, out, lse, col_ptr, row_idx, scale, dq, dk, dv);
  return {dq, dk, dv};
}

}  // namespace ldsparse

TORCH_LIBRARY_IMPL(ldsparse, CPU, m) {
  m.impl("block_attn_fwd", &ldsparse::block_attn_fwd_cpu);
  m.impl("block_attn_bwd", &ldsparse::block_attn_bwd_cpu);
}
