// CPU implementations of the ldsparse ops: OpenMP driver around the per-ISA kernels.
//
// Parallel scheme (CPU analogue of Sputnik's row swizzle + 1-D tiling): CSR rows are cut
// into a few contiguous chunks holding equal shares of non-zeros; each work item is one
// chunk x one token tile, whose dense operand is packed feature-major into a per-thread
// tile that stays in cache while the chunk's rows read it.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_dispatch.h"
#include "sparse_checks.h"

namespace ldsparse {

namespace {
const char* const kIsaNames[] = {"default", "avx2", "avx512"};

int widest_isa() {  // 0 default, 1 avx2, 2 avx512
  static const int widest = [] {
    int w = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) w = 1;
    if (w == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
      w = 2;
#endif
    return w;
  }();
  return widest;
}

int isa_index(const char* name) {
  for (int i = 0; i <= widest_isa(); ++i)
    if (name && !std::strcmp(name, kIsaNames[i])) return i;
  return -1;
}

std::atomic<int> g_isa{[] {
  const int requested = isa_index(std::getenv("LDSPARSE_ISA"));
  return requested >= 0 ? requested : widest_isa();
}()};
}  // namespace

const char* selected_isa() { return kIsaNames[g_isa.load()]; }

// Narrow (or restore) the kernels' ISA at run time, for tests and A/B timing; an ISA the
// CPU lacks is refused.
bool set_cpu_isa(const std::string& name) {
  const int i = isa_index(name.c_str());
  if (i >= 0) g_isa.store(i);
  return i >= 0;
}

const CpuKernels<float>& cpu_kernels(float) {
  const char* isa = selected_isa();
  if (!std::strcmp(isa, "avx512")) return isa_avx512::kernels_f32();
  if (!std::strcmp(isa, "avx2")) return isa_avx2::kernels_f32();
  return isa_default::kernels_f32();
}
const CpuKernels<double>& cpu_kernels(double) {
  const char* isa = selected_isa();
  if (!std::strcmp(isa, "avx512")) return isa_avx512::kernels_f64();
  if (!std::strcmp(isa, "avx2")) return isa_avx2::kernels_f64();
  return isa_default::kernels_f64();
}

namespace {

// Widest tile whose packed operand fits `budget` bytes (LDSPARSE_TILE_BYTES overrides it), but no
// wider than the tokens need (a decode step with 1 token must not pay for 128 padded lanes).
int choose_tile(int64_t tokens, int64_t packed_features, int64_t elem_size, int max_width,
                int64_t budget) {
  static const int64_t forced = [] {
    const char* env = std::getenv("LDSPARSE_TILE_BYTES");
    return env ? std::atoll(env) : int64_t(0);
  }();
  if (forced > 0) budget = forced;
  int best = 0;
  for (int i = 0; i < kNumTileWidths; ++i) {
    const int w = kTileWidths[i];
    if (w > max_width) break;
    if (i > 0 && w * packed_features * elem_size > budget) break;
    best = i;
    if (w >= tokens) break;
  }
  return best;
}

// Tile budgets, measured on a 2-core Zen 4 (32 KiB L1d, 1 MiB L2; AVX2 and AVX-512).
// SpMM reads tile rows in CSR column order, one per non-zero, so it is bound by L2 -> L1 traffic
// and a smaller tile runs faster (768 features: 32 tokens, 98 KiB, beat 64 tokens, 196 KiB, by
// 15 %).  SDDMM pays a horizontal sum per non-zero and tile, so it wants the widest tile that
// keeps g's row in registers, even at the price of a tile that fills more of L2 (3072 features:
// 32 tokens, 384 KiB, beat 16 tokens by 18 %).
constexpr int64_t kSpmmTileBytes = int64_t(128) * 1024;
constexpr int64_t kSddmmTileBytes = int64_t(512) * 1024;

// Row boundary p of `parts` chunks holding equal non-zeros plus one unit per row (its
// output write), so skewed patterns do not idle a core (row swizzle, CPU flavour).
int64_t balanced_bound(const int32_t* crow, int64_t rows, int64_t p, int64_t parts) {
  if (p <= 0) return 0;
  if (p >= parts) return rows;
  const int64_t total = static_cast<int64_t>(crow[rows]) + rows;
  const int64_t target = total * p / parts;
  int64_t lo = 0, hi = rows;  // smallest r with crow[r] + r >= target
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(crow[mid]) + mid >= target) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Work split: `chunks` nnz-balanced row blocks x token tiles, scheduled dynamically so a
// core stalled by another process does not hold the others back.  Each work item packs
// its own tile (no barriers); packing is repeated once per row chunk, so chunks stay few.
int64_t row_chunks(int64_t rows, int64_t ntiles, int threads) {
  int64_t chunks = threads;
  while (chunks * ntiles < 4 * threads && chunks < rows) chunks *= 2;  // few tokens: split rows more
  return std::max<int64_t>(1, std::min(chunks, rows));
}

// The O(1) part of CSR validity the kernels rely on to stay in bounds, read on the host (the
// CUDA op skips it: reading device memory would sync and break CUDA-graph capture).
void check_csr_ends(const at::Tensor& crow, const at::Tensor& col, const char* op) {
  const int32_t* cr = crow.data_ptr<int32_t>();
  const int64_t rows = crow.numel() - 1;
  TORCH_CHECK(cr[0] == 0 && cr[rows] == col.numel(), op, ": crow_indices must start at 0 and end at "
              "the number of non-zeros (", num(col.numel()), "), got ", num(cr[0]), " and ", num(cr[rows]));
}

struct Scratch {  // 64-byte aligned per-thread tile buffer
  explicit Scratch(size_t n) : p(static_cast<char*>(std::aligned_alloc(64, ((n + 63) / 64) * 64))) {}
  ~Scratch() { std::free(p); }
  template <typename T> T* as() { return reinterpret_cast<T*>(p); }
  char* p;
};

template <typename T>
void spmm_cpu_typed(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& values,
                    const at::Tensor& x, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t tokens = x.size(0), feats = x.size(1), rows = crow.numel() - 1;
  const auto& kern = cpu_kernels(T());
  const int ti = choose_tile(tokens, feats, sizeof(T), 64, kSpmmTileBytes);
  const int64_t tw = kTileWidths[ti];
  const int32_t* cr = crow.data_ptr<int32_t>();
  const int32_t* ci = col.data_ptr<int32_t>();
  const T* v = values.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  const int threads = at::get_num_threads();
  const int64_t ntiles = (tokens + tw - 1) / tw, chunks = row_chunks(rows, ntiles, threads);
#pragma omp parallel num_threads(threads)
  {
    Scratch tile(sizeof(T) * feats * tw);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < ntiles * chunks; ++item) {
      const int64_t t = item / chunks, c = item % chunks;
      const int64_t t0 = t * tw, tt = std::min<int64_t>(tw, tokens - t0);
      kern.pack[ti](xp, feats, t0, tt, 0, feats, tile.as<T>());
      kern.spmm[ti](cr, ci, v, balanced_bound(cr, rows, c, chunks),
                    balanced_bound(cr, rows, c + 1, chunks), tile.as<T>(), bp, yp + t0 * rows,
                    rows, tt);
    }
  }
}

template <typename T>
void sddmm_cpu_typed(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& g,
                     const at::Tensor& x, at::Tensor& out) {
  const int64_t tokens = x.size(0), kx = x.size(1), rows = crow.numel() - 1, nnz = col.numel();
  const auto& kern = cpu_kernels(T());
  const int ti = choose_tile(tokens, kx, sizeof(T), kTileWidths[kern.sddmm_widest_in_registers],
                       kSddmmTileBytes);
  const int64_t tw = kTileWidths[ti];
  const int32_t* cr = crow.data_ptr<int32_t>();
  const int32_t* ci = col.data_ptr<int32_t>();
  const T* xp = x.data_ptr<T>();
  const T* gp = g.data_ptr<T>();
  const int threads = at::get_num_threads();
  const int64_t ntiles = (tokens + tw - 1) / tw, chunks = row_chunks(rows, ntiles, threads);
  // Token groups accumulate into separate partial sums (reduced below) so items of the
  // same row chunk can run concurrently without racing on the output.
  const int64_t groups = std::min<int64_t>(ntiles, std::max<int64_t>(1, 4 * threads / chunks));
  std::vector<T> partial(groups > 1 ? static_cast<size_t>(groups * nnz) : 0, T(0));
  T* op = out.data_ptr<T>();
  const int64_t max_rows = [&] {
    int64_t m = 0;
    for (int64_t c = 0; c < chunks; ++c)
      m = std::max(m, balanced_bound(cr, rows, c + 1, chunks) - balanced_bound(cr, rows, c, chunks));
    return m;
  }();
#pragma omp parallel num_threads(threads)
  {
    Scratch xtile(sizeof(T) * kx * tw), gtile(sizeof(T) * std::max<int64_t>(1, max_rows) * tw);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < groups * chunks; ++item) {
      const int64_t grp = item / chunks, c = item % chunks;
      const int64_t r0 = balanced_bound(cr, rows, c, chunks), r1 = balanced_bound(cr, rows, c + 1, chunks);
      T* dst = groups > 1 ? partial.data() + grp * nnz : op;
      for (int64_t t = grp; t < ntiles; t += groups) {
        const int64_t t0 = t * tw, tt = std::min<int64_t>(tw, tokens - t0);
        kern.pack[ti](xp, kx, t0, tt, 0, kx, xtile.as<T>());
        kern.pack[ti](gp, rows, t0, tt, r0, r1, gtile.as<T>());
        kern.sddmm[ti](cr, ci, r0, r1, r0, gtile.as<T>(), xtile.as<T>(), dst);
      }
    }
    if (groups > 1) {
#pragma omp for schedule(static)
      for (int64_t j = 0; j < nnz; ++j) {
        T s = 0;
        for (int64_t grp = 0; grp < groups; ++grp) s += partial[grp * nnz + j];
        op[j] = s;
      }
    }
  }
}

}  // namespace

at::Tensor spmm_cpu(const at::Tensor& crow_in, const at::Tensor& col_in, const at::Tensor& values,
                    const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in) {
  check_spmm(crow_in, col_in, values, x_in, bias_in);
  const auto crow = crow_in.contiguous(), col = col_in.contiguous();
  check_csr_ends(crow, col, "ldsparse.spmm");
  const auto x = x_in.contiguous();
  const auto vals = values.contiguous();
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  const int64_t rows = crow.numel() - 1;
  auto y = at::empty({x.size(0), rows}, x.options());
  if (x.size(0) == 0 || rows == 0) return y;
  switch (x.scalar_type()) {
    case at::kFloat: spmm_cpu_typed<float>(crow, col, vals, x, bias, y); break;
    case at::kDouble: spmm_cpu_typed<double>(crow, col, vals, x, bias, y); break;
    default: TORCH_CHECK(false, "ldsparse.spmm (CPU): only float32/float64, got ", x.scalar_type());
  }
  return y;
}

at::Tensor sddmm_cpu(const at::Tensor& crow_in, const at::Tensor& col_in, const at::Tensor& g_in,
                     const at::Tensor& x_in) {
  check_sddmm(crow_in, col_in, g_in, x_in);
  const auto crow = crow_in.contiguous(), col = col_in.contiguous();
  check_csr_ends(crow, col, "ldsparse.sddmm");
  const auto g = g_in.contiguous();
  const auto x = x_in.contiguous();
  auto out = at::zeros({col.numel()}, x.options());
  if (x.size(0) == 0 || col.numel() == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: sddmm_cpu_typed<float>(crow, col, g, x, out); break;
    case at::kDouble: sddmm_cpu_typed<double>(crow, col, g, x, out); break;
    default: TORCH_CHECK(false, "ldsparse.sddmm (CPU): only float32/float64, got ", x.scalar_type());
  }
  return out;
}

// Transpose of the pattern by counting sort: W^T's CSR plus perm with valuesT = values[perm].
std::tuple<at::Tensor, at::Tensor, at::Tensor> csr_transpose_cpu(const at::Tensor& crow_in,
                                                                 const at::Tensor& col_in,
                                                                 int64_t n_cols) {
  check_csr(crow_in, col_in, "ldsparse.csr_transpose");
  TORCH_CHECK(n_cols >= 0, "ldsparse.csr_transpose: n_cols must be >= 0, got ", num(n_cols));
  check_fits_int(n_cols, "n_cols", "ldsparse.csr_transpose");
  const auto crow = crow_in.cpu().contiguous(), col = col_in.cpu().contiguous();
  check_csr_ends(crow, col, "ldsparse.csr_transpose");
  const int64_t rows = crow.numel() - 1, nnz = col.numel();
  auto opts = crow.options();
  auto crow_t = at::zeros({n_cols + 1}, opts);
  auto col_t = at::empty({nnz}, opts);
  auto perm = at::empty({nnz}, opts);
  const int32_t* cr = crow.data_ptr<int32_t>();
  const int32_t* ci = col.data_ptr<int32_t>();
  int32_t* ct = crow_t.data_ptr<int32_t>();
  for (int64_t j = 0; j < nnz; ++j) {
    TORCH_CHECK(ci[j] >= 0 && ci[j] < n_cols, "ldsparse.csr_transpose: col_indices[", num(j), "] = ",
                num(ci[j]), " is outside [0, n_cols = ", num(n_cols), ")");
    ++ct[ci[j] + 1];
  }
  for (int64_t c = 0; c < n_cols; ++c) ct[c + 1] += ct[c];
  std::vector<int32_t> next(ct, ct + n_cols);
  int32_t* rt = col_t.data_ptr<int32_t>();
  int32_t* pt = perm.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t j = cr[r]; j < cr[r + 1]; ++j) {
      const int32_t dst = next[ci[j]]++;
      rt[dst] = static_cast<int32_t>(r);
      pt[dst] = j;
    }
  const auto dev = crow_in.device();
  return {crow_t.to(dev), col_t.to(dev), perm.to(dev)};
}

}  // namespace ldsparse

TORCH_LIBRARY_IMPL(ldsparse, CPU, m) {
  m.impl("spmm", &ldsparse::spmm_cpu);
  m.impl("sddmm", &ldsparse::sddmm_cpu);
}

// The transpose runs once per pattern; on any device it computes on the host.
TORCH_LIBRARY_IMPL(ldsparse, CompositeExplicitAutograd, m) {
  m.impl("csr_transpose", &ldsparse::csr_transpose_cpu);
}
