// CUDA kernels of the sparse linear layer (torch-free: CUDA runtime headers only; compiled by
// sparse_kernels.cu, bound to torch by sparse_binding.cpp).  Five SpMM kernels, chosen by
// LDSPARSE_SPMM_KERNEL: v1 (tiled, below; the bf16 kernel), v2 (v1 + cp.async staging), v3-v5
// (the entry stream, further down; v5 is the fp32 default).  H200 figures of all five:
// benchmarks/results/2026-11-28-gpu.md.
//
// SpMM, y[t, r] = bias[r] + sum_p values[p] * x[t, col[p]] over the CSR row r, on token-major
// activations x [n, K] and y [n, rows] (the layer's own layout: no transposes).
//
// Why this shape: unstructured SpMM does one FMA per dense element it reads, so it
// is bound by how fast the dense operand reaches the FMA units. Reading it from L2 per non-zero
// (one warp per CSR row, the previous design) moves nnz * n * 4 bytes through L2: slower than
// cuBLAS at every sparsity on Hopper. Here a block owns a 128-row x 128-token output tile and
// walks K in chunks of 32 columns; each chunk of x (128 tokens x 32 columns) is staged in shared
// memory once and serves every non-zero of the tile's 128 rows that falls in the chunk (as in
// Sputnik, the sparse row's values are broadcast and the dense operand is what is tiled).
//   * A warp owns 16 rows and walks each row's non-zeros of the chunk; every lane computes 4
//     tokens, so a non-zero costs 4 shared loads + 4 FMAs per lane and no divergence (the whole
//     warp is on one row).
//   * The shared tile is [token][column] with pitch 33: lanes (consecutive tokens) reading one
//     column hit 32 different banks, and the staging stores (consecutive columns) do too.
//   * Double buffering: the next chunk's global loads are issued before the current chunk is
//     computed and stored after it; one barrier per chunk.
//   * Where each row's non-zeros of a chunk start comes from chunk_ptr (c-major, [chunks+1][rows]),
//     built per call by a binary-search kernel (a few microseconds): no per-call sort.
// Columns must be sorted within each row (csr_pattern and csr_transpose build them so).
// Accumulation is fp32 for every storage type (fp32, bf16).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace ldsparse {
namespace cuda {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kTileRows = 128;                           // output features per block
constexpr int kTileTokens = 128;                         // tokens per block
constexpr int kChunk = 32;                               // columns of x staged per step
constexpr int kWarps = 8;
constexpr int kThreads = kWarp * kWarps;
constexpr int kRowsPerWarp = kTileRows / kWarps;         // 16
constexpr int kTokensPerLane = kTileTokens / kWarp;      // 4
constexpr int kPitch = kChunk + 1;                       // shared row pitch (floats)
constexpr int kStagePerThread = kTileTokens * kChunk / kThreads;  // 16
constexpr unsigned kMaxGridY = 65535;
static_assert(kRowsPerWarp <= kWarp, "one lane per row loads the row pointers");

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

inline int spmm_chunks(int64_t k) { return static_cast<int>((k + kChunk - 1) / kChunk); }

// chunk_ptr[c * rows + r] = first p in [crow[r], crow[r+1]) with col[p] >= c * kChunk.
__global__ void chunk_ptr_kernel(const int32_t* __restrict__ crow, const int32_t* __restrict__ col,
                                 int32_t* __restrict__ chunk_ptr, int rows, int chunks) {
  const int64_t total = static_cast<int64_t>(chunks + 1) * rows;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e / rows;
    const int r = static_cast<int>(e - c * rows);
    const int64_t key = c * kChunk;
    int lo = crow[r], hi = crow[r + 1];
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (col[mid] < key) lo = mid + 1; else hi = mid;
    }
    chunk_ptr[e] = lo;
  }
}

// grid = (ceil(n / kTileTokens), min(ceil(rows / kTileRows), kMaxGridY)), block = kThreads.
// Row tiles beyond gridDim.y are looped over (any row count fits).
template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
spmm_tiled_kernel(const int32_t* __restrict__ chunk_ptr, const int32_t* __restrict__ col,
                  const T* __restrict__ values, const T* __restrict__ x, const T* __restrict__ bias,
                  T* __restrict__ y, int rows, int K, int n, int chunks) {
  __shared__ float tile[2][kTileTokens * kPitch];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int row_tiles = (rows + kTileRows - 1) / kTileRows;
  float stage[kStagePerThread];
  // Staging: lane = column within the chunk, tokens warp, warp + 8, ...: coalesced along K.
  const auto fetch = [&](int c) {
    const int64_t k = static_cast<int64_t>(c) * kChunk + lane;
#pragma unroll
    for (int i = 0; i < kStagePerThread; ++i) {
      const int64_t t = t0 + warp + kWarps * i;
      stage[i] = (t < n && k < K) ? to_float(x[t * K + k]) : 0.f;
    }
  };
  const auto store = [&](float* buf) {
#pragma unroll
    for (int i = 0; i < kStagePerThread; ++i) buf[(warp + kWarps * i) * kPitch + lane] = stage[i];
  };

  for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int r0 = rt * kTileRows + warp * kRowsPerWarp;
    const int my_row = r0 + lane % kRowsPerWarp;  // lanes 16..31 mirror lanes 0..15
    const bool row_ok = my_row < rows;
    int cur[kRowsPerWarp];
    {
      const int p = row_ok ? chunk_ptr[my_row] : 0;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) cur[i] = __shfl_sync(kFull, p, i);
    }
    int next_end = row_ok ? chunk_ptr[static_cast<int64_t>(rows) + my_row] : 0;
    float acc[kRowsPerWarp][kTokensPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < kTokensPerLane; ++j) acc[i][j] = 0.f;

    fetch(0);
    store(tile[0]);
    __syncthreads();
    for (int c = 0; c < chunks; ++c) {
      const bool more = c + 1 < chunks;
      if (more) fetch(c + 1);  // in flight while this chunk is computed
      const int end_lane = next_end;
      if (more) next_end = row_ok ? chunk_ptr[static_cast<int64_t>(c + 2) * rows + my_row] : 0;
      // Lane's tokens are lane, lane + 32, ...; the non-zero's column selects the tile column.
      const float* base = tile[c & 1] + lane * kPitch - c * kChunk;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int end = __shfl_sync(kFull, end_lane, i);
#pragma unroll 2
        for (int p = cur[i]; p < end; ++p) {
          const float w = to_float(values[p]);
          const float* b = base + col[p];
#pragma unroll
          for (int j = 0; j < kTokensPerLane; ++j) acc[i][j] = fmaf(w, b[j * kWarp * kPitch], acc[i][j]);
        }
        cur[i] = end;
      }
      if (more) store(tile[(c + 1) & 1]);
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < kTokensPerLane; ++j) {
      const int64_t t = t0 + lane + j * kWarp;
      if (t >= n) continue;
      T* out = y + t * rows;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = r0 + i;
        if (r < rows) out[r] = from_float<T>(acc[i][j] + (bias ? to_float(bias[r]) : 0.f));
      }
    }
  }
}

// ---------------------------------------------------------------------------- SpMM v2 (fp32)
// Same tiling as spmm_tiled_kernel, built against what the H200 run of v1 showed
// (benchmarks/results/2026-11-28-gpu.md: 0.42x cuBLAS at 75 %, 0.75x at 90 %, and 1.9 ms at 99 %
// where the FMAs are nearly gone): v1 reads each non-zero's (value, column) from global memory
// inside the dependent inner loop, one L2 round trip per non-zero per row.  v2 stages them too:
//   * per chunk, every warp copies its 16 rows' (value, column) pairs of the chunk (<= 32 a row)
//     into its own shared slice with cp.async, one chunk ahead, so the inner loop reads only
//     shared memory (one broadcast 8-byte load + 4 loads + 4 FMAs per non-zero and lane);
//   * the x tile is staged with cp.async as well (zero-filled past the edges), which frees v1's
//     16 staging registers;
//   * two barriers per chunk (before refilling a buffer, after its copies land).
// fp32 only: cp.async moves 4-byte words (bf16 keeps v1; bf16 is 2:4's and cuBLAS's domain).
// Selected with LDSPARSE_SPMM_KERNEL=v2 until a GPU run has measured it (sparse_binding.cpp).
constexpr int kEntriesPerRow = kChunk;  // a row has at most kChunk non-zeros in a chunk
struct Entry {
  float w;
  int32_t col;
};
constexpr size_t kV2TileFloats = static_cast<size_t>(kTileTokens) * kPitch;
constexpr size_t kV2SliceEntries = static_cast<size_t>(kRowsPerWarp) * kEntriesPerRow;
constexpr size_t kV2Smem = 2 * (kV2TileFloats * sizeof(float) + kWarps * kV2SliceEntries * sizeof(Entry));

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// grid and row-tile loop as spmm_tiled_kernel; dynamic shared memory kV2Smem.
__global__ void __launch_bounds__(kThreads, 2)
spmm_staged_kernel(const int32_t* __restrict__ chunk_ptr, const int32_t* __restrict__ col,
                   const float* __restrict__ values, const float* __restrict__ x, const float* __restrict__ bias,
                   float* __restrict__ y, int rows, int K, int n, int chunks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* tiles = reinterpret_cast<float*>(smem_raw);                                 // [2][tokens][pitch]
  Entry* slices = reinterpret_cast<Entry*>(smem_raw + 2 * kV2TileFloats * sizeof(float));  // [2][warps][16][32]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int row_tiles = (rows + kTileRows - 1) / kTileRows;

  for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int r0 = rt * kTileRows + warp * kRowsPerWarp;
    const int my_row = r0 + lane % kRowsPerWarp;  // lanes 16..31 mirror lanes 0..15
    const bool row_ok = my_row < rows;
    const auto ptr = [&](int c) {  // this lane's row's first entry of chunk c
      return row_ok ? chunk_ptr[static_cast<int64_t>(c) * rows + my_row] : 0;
    };
    // Copy chunk c's x tile and this warp's rows' entries [begin, end) into buffer c & 1.
    const auto stage = [&](int c, int begin, int end) {
      float* tile = tiles + (c & 1) * kV2TileFloats;
      const int64_t k = static_cast<int64_t>(c) * kChunk + lane;
#pragma unroll 1
      for (int i = 0; i < kStagePerThread; ++i) {  // not unrolled: 16 live addresses cost spills
        const int tt = warp + kWarps * i;
        const int64_t t = t0 + tt;
        const bool ok = t < n && k < K;
        cp_async4(tile + tt * kPitch + lane, ok ? x + t * K + k : x, ok);
      }
      Entry* slice = slices + ((c & 1) * kWarps + warp) * kV2SliceEntries;
#pragma unroll 1
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int b = __shfl_sync(kFull, begin, i), e = __shfl_sync(kFull, end, i);
        if (lane < min(e - b, kEntriesPerRow)) {  // <= kEntriesPerRow in a valid (sorted, unique) row
          cp_async4(&slice[i * kEntriesPerRow + lane].w, values + b + lane, true);
          cp_async4(&slice[i * kEntriesPerRow + lane].col, col + b + lane, true);
        }
      }
      cp_async_commit();
    };
    float acc[kRowsPerWarp][kTokensPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < kTokensPerLane; ++j) acc[i][j] = 0.f;

    int begin = ptr(0), end = ptr(1);       // chunk c's entries of this lane's row
    int next_end = chunks > 1 ? ptr(2) : 0;  // chunk c + 1's end
    __syncthreads();                         // the previous row tile is done with the buffers
    stage(0, begin, end);
    for (int c = 0; c < chunks; ++c) {
      const bool more = c + 1 < chunks;
      if (more) {
        __syncthreads();  // every warp is done with buffer (c + 1) & 1 (chunk c - 1)
        stage(c + 1, end, next_end);
      }
      const int count = min(end - begin, kEntriesPerRow);
      begin = end;
      end = next_end;
      if (c + 2 < chunks) next_end = ptr(c + 3);  // used two chunks on: its latency is hidden
      if (more) cp_async_wait<1>(); else cp_async_wait<0>();  // chunk c's copies have landed
      __syncthreads();
      const float* base = tiles + (c & 1) * kV2TileFloats + lane * kPitch - c * kChunk;
      const Entry* slice = slices + ((c & 1) * kWarps + warp) * kV2SliceEntries;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int cnt = __shfl_sync(kFull, count, i);
        const Entry* row = slice + i * kEntriesPerRow;
#pragma unroll 2
        for (int q = 0; q < cnt; ++q) {
          const Entry e = row[q];
          const float* b = base + e.col;
#pragma unroll
          for (int j = 0; j < kTokensPerLane; ++j) acc[i][j] = fmaf(e.w, b[j * kWarp * kPitch], acc[i][j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kTokensPerLane; ++j) {
      const int64_t t = t0 + lane + j * kWarp;
      if (t >= n) continue;
      float* out = y + t * rows;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = r0 + i;
        if (r < rows) out[r] = acc[i][j] + (bias ? bias[r] : 0.f);
      }
    }
  }
}

inline cudaError_t launch_spmm_staged(const int32_t* chunk_ptr, const int32_t* col, const float* values,
                                      const float* x, const float* bias, float* y, int rows, int K, int n,
                                      int chunks, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(spmm_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kV2Smem));
  if (err != cudaSuccess) return err;
  const int64_t row_tiles = (static_cast<int64_t>(rows) + kTileRows - 1) / kTileRows;
  const dim3 grid(static_cast<unsigned>((static_cast<int64_t>(n) + kTileTokens - 1) / kTileTokens),
                  static_cast<unsigned>(row_tiles < kMaxGridY ? row_tiles : kMaxGridY));
  spmm_staged_kernel<<<grid, kThreads, kV2Smem, stream>>>(chunk_ptr, col, values, x, bias, y, rows, K, n, chunks);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------- SpMM v3 (fp32)
// The "entry stream" kernel.  What bounds unstructured SpMM on Hopper (the roofline behind v1's
// figures): every FMA needs one distinct dense value, so x must come from shared memory at 4
// bytes a lane per FMA; shared memory delivers 128 bytes a clock per SM while the SM issues 128
// fp32 FMAs a clock, so no SIMT SpMM exceeds 25 % of fp32 peak (A100: 50 %, hence Sputnik's
// lead there).  v3 spends that budget on FMAs only:
//   * The non-zeros are re-laid per call (the binding's plan: chunk_ptr, a prefix sum and
//     spmm_stream_scatter_kernel below) as one stream ordered by
//     (row tile, chunk, row): entry = (value, column's offset in the shared x tile).  A block's
//     entries of a chunk are contiguous, so they are copied to shared memory with coalesced
//     8-byte cp.async one chunk ahead; where each row starts is read from the same scan.
//   * A block owns 64 rows x 256 tokens: 8 warps x 8 rows, 8 tokens a lane, so a non-zero costs
//     one broadcast load + 8 conflict-free loads + 8 FMAs (v1: 1 + 4 + 4 from global).
//   * x is staged [column][token] with pitch 257 by 4-byte cp.async (coalesced along K,
//     conflict-free stores and loads), so no staging registers: 64 accumulators, 2 blocks an SM
//     (one block's barrier wait is the other's compute).
//   * Output goes through shared memory so y is written in coalesced 256-byte rows.
//   * Row tiles vary fastest in the grid: the resident blocks share a few token tiles of x
//     (4 MB each), which stay in L2.
// Measured (H200, M=N=K=4096, fp32): v5 (256 x 128) 1.23x cuBLAS at 90 %, 2.64x at 99 %; the
// time is about 0.9 ms + 13 ms x density.  The slope is ~60 % of the shared-memory roof above; the
// 0.9 ms is the chunk loop's latency: 128 chunks a tile, each one cp.async round trip and one
// barrier, with a single chunk in flight (what a deeper pipeline would attack next).
// One barrier per chunk: the copies of chunk c + 1 go into the other buffer, which every warp
// left at the previous barrier.  fp32 only.  A row has at most kChunk entries in a chunk (valid
// CSR: sorted, unique columns); the copies and loops are clamped to the buffer all the same, so
// a corrupt pattern gives wrong numbers, never out-of-bounds shared memory.
// The tile geometry, one struct per variant (LDSPARSE_SPMM_KERNEL): v3 64 rows x 256 tokens,
// v4 128 x 128 and v5 256 x 128 (fewer row tiles stage x fewer times: x moves from L2 to shared
// memory once per row tile, the cost that stays when the non-zeros are few).
template <int WARPS, int ROWS_PER_WARP, int TOKENS_PER_LANE, int MIN_BLOCKS>
struct StreamTile {
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = kWarp * WARPS;
  static constexpr int kRowsPerWarp = ROWS_PER_WARP;
  static constexpr int kRows = WARPS * ROWS_PER_WARP;
  static constexpr int kTokensPerLane = TOKENS_PER_LANE;
  static constexpr int kTokens = kWarp * TOKENS_PER_LANE;
  static constexpr int kPitch = kTokens + 1;                    // x tile [column][token]
  static constexpr int kXFloats = kChunk * kPitch;
  static constexpr int kMaxEntries = kRows * kChunk;            // a dense chunk
  static constexpr int kOutPitch = kRows + 1;                   // y tile [token][row]
  static constexpr int kMinBlocks = MIN_BLOCKS;
  static constexpr size_t kBuffers = 2 * (static_cast<size_t>(kXFloats) * sizeof(float) +
                                          static_cast<size_t>(kMaxEntries) * sizeof(int2));
  static constexpr size_t kOut = static_cast<size_t>(kTokens) * kOutPitch * sizeof(float);
  static constexpr size_t kSmem = kBuffers > kOut ? kBuffers : kOut;
  static_assert((2 * kXFloats * sizeof(float)) % sizeof(int2) == 0, "entry buffers are 8-byte aligned");
  static_assert((kTokens * kChunk) % kThreads == 0, "x staging splits evenly");
};
using StreamV3 = StreamTile<8, 8, 8, 2>;
using StreamV4 = StreamTile<8, 16, 4, 2>;
using StreamV5 = StreamTile<16, 16, 4, 1>;

__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(gmem));
}

// Plan: one thread per (chunk c, row r) copies the row's entries of chunk c to
// stream[scan[(tile(r) * chunks + c) * kRows + r % kRows] ...] as (value bits, column offset in
// the shared x tile).  chunk_ptr as for v1 (c-major).
__global__ void spmm_stream_scatter_kernel(const int32_t* __restrict__ chunk_ptr, const int32_t* __restrict__ col,
                                           const float* __restrict__ values, const int32_t* __restrict__ scan,
                                           int2* __restrict__ stream, int rows, int chunks, int tile_rows,
                                           int pitch) {
  const int64_t total = static_cast<int64_t>(chunks) * rows;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e / rows;
    const int r = static_cast<int>(e - c * rows);
    const int begin = chunk_ptr[e], end = chunk_ptr[e + rows];
    const int64_t slot = (static_cast<int64_t>(r / tile_rows) * chunks + c) * tile_rows + r % tile_rows;
    int2* out = stream + scan[slot];
    const int64_t k0 = c * kChunk;
    for (int p = begin; p < end; ++p)
      out[p - begin] = make_int2(__float_as_int(values[p]), static_cast<int>(col[p] - k0) * pitch);
  }
}

// grid = (row tiles, min(token tiles, kMaxGridY)), block = Tile::kThreads, dynamic smem Tile::kSmem.
// scan: int32 [row tiles * chunks * kRows + 1], exclusive prefix of the entry counts in stream order.
template <class Tile>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks)
spmm_stream_kernel(const int32_t* __restrict__ scan, const int2* __restrict__ stream, const float* __restrict__ x,
                   const float* __restrict__ bias, float* __restrict__ y, int rows, int K, int n, int chunks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* xs = reinterpret_cast<float*>(smem_raw);                                   // [2][kChunk][Tile::kPitch]
  int2* es = reinterpret_cast<int2*>(smem_raw + 2 * Tile::kXFloats * sizeof(float));      // [2][Tile::kMaxEntries]
  float* ys = reinterpret_cast<float*>(smem_raw);                                   // [Tile::kTokens][Tile::kOutPitch]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int rt = blockIdx.x;
  const int r0 = rt * Tile::kRows;
  const int64_t g0 = static_cast<int64_t>(rt) * chunks;  // stream group of (rt, chunk 0)
  const auto group_start = [&](int64_t g) { return scan[g * Tile::kRows]; };
  const int token_tiles = static_cast<int>((static_cast<int64_t>(n) + Tile::kTokens - 1) / Tile::kTokens);

  for (int tile = blockIdx.y; tile < token_tiles; tile += gridDim.y) {
    const int64_t t0 = static_cast<int64_t>(tile) * Tile::kTokens;
    // Copy chunk c's x tile and the block's entries [bs, be) into buffer c & 1 (async).
    const auto stage = [&](int c, int bs, int be) {
      float* xb = xs + (c & 1) * Tile::kXFloats + lane * Tile::kPitch;
      const int64_t k = static_cast<int64_t>(c) * kChunk + lane;
      const bool k_ok = k < K;
#pragma unroll 4
      for (int i = 0; i < Tile::kTokens / Tile::kWarps; ++i) {
        const int tt = warp + Tile::kWarps * i;
        const int64_t t = t0 + tt;
        const bool ok = k_ok && t < n;
        cp_async4(xb + tt, ok ? x + t * K + k : x, ok);
      }
      int2* eb = es + (c & 1) * Tile::kMaxEntries;
      const int end = min(be, bs + Tile::kMaxEntries);
      for (int e = bs + static_cast<int>(threadIdx.x); e < end; e += Tile::kThreads) cp_async8(eb + (e - bs), stream + e);
      cp_async_commit();
    };
    // Row starts of this warp's 8 rows (lanes 0..8) in chunk c's group.
    const auto row_starts = [&](int c) {
      return lane <= Tile::kRowsPerWarp ? scan[(g0 + c) * Tile::kRows + warp * Tile::kRowsPerWarp + lane] : 0;
    };

    float acc[Tile::kRowsPerWarp][Tile::kTokensPerLane];
#pragma unroll
    for (int i = 0; i < Tile::kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < Tile::kTokensPerLane; ++j) acc[i][j] = 0.f;

    int bs = group_start(g0), be = group_start(g0 + 1);
    int starts = row_starts(0);
    int bs1 = 0, be1 = 0;
    if (chunks > 1) {
      bs1 = be;
      be1 = group_start(g0 + 2);
    }
    __syncthreads();  // the previous token tile is done with the buffers
    stage(0, bs, be);
    cp_async_wait<0>();
    __syncthreads();
    for (int c = 0; c < chunks; ++c) {
      const bool more = c + 1 < chunks;
      int starts1 = 0, bs2 = 0, be2 = 0;
      if (more) {
        stage(c + 1, bs1, be1);
        starts1 = row_starts(c + 1);
        if (c + 2 < chunks) {
          bs2 = be1;
          be2 = group_start(g0 + c + 3);
        }
      }
      const float* xb = xs + (c & 1) * Tile::kXFloats + lane;
      const int2* eb = es + (c & 1) * Tile::kMaxEntries;
      const int local = min(max(starts - bs, 0), Tile::kMaxEntries);  // row starts in the buffer
      int s = __shfl_sync(kFull, local, 0);
#pragma unroll
      for (int i = 0; i < Tile::kRowsPerWarp; ++i) {
        const int e = __shfl_sync(kFull, local, i + 1);
#pragma unroll 2
        for (int q = s; q < e; ++q) {
          const int2 en = eb[q];
          const float w = __int_as_float(en.x);
          const float* b = xb + en.y;
#pragma unroll
          for (int j = 0; j < Tile::kTokensPerLane; ++j) acc[i][j] = fmaf(w, b[j * kWarp], acc[i][j]);
        }
        s = e;
      }
      cp_async_wait<0>();
      __syncthreads();  // chunk c + 1 has landed; every warp is done with buffer c & 1
      bs = bs1;
      be = be1;
      bs1 = bs2;
      be1 = be2;
      starts = starts1;
    }
    // y tile through shared memory: [token][row], then 256-byte rows of y.
#pragma unroll
    for (int i = 0; i < Tile::kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < Tile::kTokensPerLane; ++j) ys[(lane + j * kWarp) * Tile::kOutPitch + warp * Tile::kRowsPerWarp + i] = acc[i][j];
    __syncthreads();
    for (int idx = threadIdx.x; idx < Tile::kTokens * Tile::kRows; idx += Tile::kThreads) {
      const int tt = idx / Tile::kRows, rr = idx % Tile::kRows;
      const int64_t t = t0 + tt;
      const int r = r0 + rr;
      if (t < n && r < rows) y[t * rows + r] = ys[tt * Tile::kOutPitch + rr] + (bias ? bias[r] : 0.f);
    }
  }
}

inline cudaError_t launch_spmm_stream_scatter(const int32_t* chunk_ptr, const int32_t* col, const float* values,
                                              const int32_t* scan, int2* stream, int rows, int chunks, int tile_rows,
                                              int pitch, cudaStream_t cuda_stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t work = static_cast<int64_t>(chunks) * rows;
  const int64_t b = (work + 255) / 256;
  spmm_stream_scatter_kernel<<<static_cast<unsigned>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16), 256, 0,
                               cuda_stream>>>(chunk_ptr, col, values, scan, stream, rows, chunks, tile_rows, pitch);
  return cudaGetLastError();
}

template <class Tile>
cudaError_t launch_spmm_stream(const int32_t* scan, const int2* stream, const float* x, const float* bias, float* y,
                               int rows, int K, int n, int chunks, cudaStream_t cuda_stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(spmm_stream_kernel<Tile>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(Tile::kSmem));
  if (err != cudaSuccess) return err;
  const int64_t row_tiles = (static_cast<int64_t>(rows) + Tile::kRows - 1) / Tile::kRows;
  const int64_t token_tiles = (static_cast<int64_t>(n) + Tile::kTokens - 1) / Tile::kTokens;
  const dim3 grid(static_cast<unsigned>(row_tiles),
                  static_cast<unsigned>(token_tiles < kMaxGridY ? token_tiles : kMaxGridY));
  spmm_stream_kernel<Tile><<<grid, Tile::kThreads, Tile::kSmem, cuda_stream>>>(scan, stream, x, bias, y, rows, K, n,
                                                                             chunks);
  return cudaGetLastError();
}

// out[p] = dense[r * K + col[p]] for every non-zero p of row r: the weight gradient restricted
// to the pattern, from the dense gradient cuBLAS computes. One warp per row.
template <typename T>
__global__ void csr_gather_kernel(const int32_t* __restrict__ crow, const int32_t* __restrict__ col,
                                  const T* __restrict__ dense, T* __restrict__ out, int rows, int K) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp; r < rows;
       r += (static_cast<int64_t>(gridDim.x) * blockDim.x) / kWarp) {
    const T* src = dense + r * K;
    for (int p = crow[r] + lane; p < crow[r + 1]; p += kWarp) out[p] = src[col[p]];
  }
}

// ----------------------------------------------------------------------------- launchers
inline unsigned blocks_for(int64_t threads, int per_block) {
  const int64_t b = (threads + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

inline cudaError_t launch_chunk_ptr(const int32_t* crow, const int32_t* col, int32_t* chunk_ptr, int rows,
                                    int chunks, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  chunk_ptr_kernel<<<blocks_for(static_cast<int64_t>(chunks + 1) * rows, 256), 256, 0, stream>>>(
      crow, col, chunk_ptr, rows, chunks);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_spmm(const int32_t* chunk_ptr, const int32_t* col, const T* values, const T* x,
                        const T* bias, T* y, int rows, int K, int n, int chunks, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const int64_t row_tiles = (static_cast<int64_t>(rows) + kTileRows - 1) / kTileRows;
  const dim3 grid(static_cast<unsigned>((static_cast<int64_t>(n) + kTileTokens - 1) / kTileTokens),
                  static_cast<unsigned>(row_tiles < kMaxGridY ? row_tiles : kMaxGridY));
  spmm_tiled_kernel<T><<<grid, kThreads, 0, stream>>>(chunk_ptr, col, values, x, bias, y, rows, K, n, chunks);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_csr_gather(const int32_t* crow, const int32_t* col, const T* dense, T* out, int rows,
                              int K, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  csr_gather_kernel<T><<<blocks_for(static_cast<int64_t>(rows) * kWarp, 256), 256, 0, stream>>>(
      crow, col, dense, out, rows, K);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ldsparse
