// Grouped expert GEMMs for decode-sized MoE steps: a batched GEMV over the experts a step touches.
//
// Why: at decode each touched expert sees a few rows (B = 64, k = 8, E = 128: about 4), so the layer is a read of
// those experts' weights (Qwen3-30B-A3B: 9.4 MB each in bf16) with little math. Each expert's weights are read
// from HBM once per step, and only the touched experts': the grid's y index walks the routing kernel's active
// list (read on the device), so an untouched expert costs neither a byte nor a CTA. The grid's size depends only
// on the token count, so a CUDA graph captured for T tokens replays whatever the step's routing is.
//
// Register-direct mma.sync as in decode_gemm.cu: a warp owns 16 weight rows (A fragments loaded straight from
// global memory, 16 bytes per lane and row per k32 block, two register batches in flight) and a 1 / KW share of
// K; a CTA is 8 warps, RW row warps x KW = 8 / RW along K, summed through shared memory (Tile below). x rows are
// the mma's n side, in passes of 8 NT rows (NT: 1, 2 or 4 n8 tiles, pass_tiles); an expert with more rows than a
// pass re-reads its weights per pass, from L2 while they are still there. Rows of a pass past the expert's count
// are loaded as its last row (in bounds) and never stored.
//
// x rows of a pass go to shared memory first where two CTAs an SM still fit (smem_x_fits): copied with cp.async
// while the first weight batches load, then read with 16-byte shared loads, so a weight batch's successor is not
// issued an L2 round trip late. Gate_up's four-tile passes (135 KB for Qwen3-30B-A3B) read x from global memory.
//
// gate_up: warp rows g are gate rows n0 + g and rows g + 8 the matching up rows, so each lane holds gate and up
// of the same (row, column) after the K sum and SwiGLU is applied before the one store of act (bf16 / fp16).
// down: each sorted pair's output row is multiplied by its routing weight in fp32 and stored, in fp32, at the
// pair's (token, slot) index; combine sums each token's k rows in slot order: no atomics, so the result does not
// depend on the order in which CTAs finish.
//
// down_combine (a few tokens): a CTA per (token, 16 or 8 output columns); its warps take jobs of 8 weight rows of one
// of the token's k slots, with plain 16-byte loads and fp32 FMAs (one act row: an mma's n side would use 1 of 8),
// and the CTA sums the weighted slots in slot order in shared memory: the combine without its launch or the fp32
// pairs buffer, at the price of reading an expert once per token that picked it instead of once per step.
#include <algorithm>

#include "common.cuh"
#include "launch.h"
#include "moe.h"
#include "weight_stream.cuh"

namespace minillm {
namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps, kBlockK = kMoeTileK;

// k32 blocks per register batch: 4 with up to two x tiles, 2 with four (as decode_gemm.cu's batch_blocks), so
// that weights, x and the accumulators fit in 128 registers (two CTAs per SM) without spills.
constexpr int batch_blocks(int nt) { return nt >= 4 ? 2 : 4; }

// A CTA's shape: NT x tiles (8 NT rows) per pass; RW row warps (16 RW weight rows) x KW = 8 / RW warps along K.
// kSmemX: the pass's x rows are copied to shared memory first (stage_x below), so the weight loads of the next
// batch never wait behind an x load from L2.
template <int NT_, int RW_, bool kSmemX_ = false>
struct Tile {
  static constexpr int NT = NT_, RW = RW_, KW = kWarps / RW, U = batch_blocks(NT), kRows = 8 * NT;
  static constexpr bool kSmemX = kSmemX_;
  static constexpr int kStride = 16 * RW + 4;  // floats per row of a K-slice tile (+4: conflict-free stores)
  static constexpr int kSmemFloats = KW * kRows * kStride;
};

// moe.h's limits are those of the two-row-warp tile (the one every shape can take); the one-row-warp gate_up
// tile (twice the CTAs, for steps that touch few experts) runs only where K / kBlockK >= 8.
static_assert(2 * 8 == kMoeGateCols && 2 * 16 == kMoeDownCols && kWarps / 2 == kMoeKWarps,
              "CTA tile and moe.h disagree");

template <typename T>
struct Stream {
  const T* w0;  // weight row of A-fragment row g, column 8t of the warp's first k32 block
  const T* w1;  // A-fragment row g + 8
  int n_kb;     // k32 blocks of this warp
};

template <typename T, int kU>
__device__ __forceinline__ void load_batch(uint4 (&r)[kU][2], const Stream<T>& s, int b, uint64_t pol) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int kb = b * kU + u;
    if (kb < s.n_kb) {
      r[u][0] = ld_weight(s.w0 + kb * kBlockK, pol);
      r[u][1] = ld_weight(s.w1 + kb * kBlockK, pol);
    } else {
      r[u][0] = r[u][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// 16 x bytes: from the pass's rows in shared memory (kShared), else from global memory through L1.
template <bool kShared>
__device__ __forceinline__ uint4 ld_xrow(const void* p) {
  if constexpr (kShared) return *reinterpret_cast<const uint4*>(p);
  return ld_x(p);
}

// acc[j] += batch b against x tiles j < tiles (warp-uniform). x row of tile j: xc + xoff[j], at column 8t of
// the warp's K start (offsets kept 32-bit: the registers go to the weights).
template <typename T, int kTiles, int kU, bool kShared>
__device__ __forceinline__ void compute_batch(float (&acc)[kTiles][4], const uint4 (&r)[kU][2], const T* xc,
                                              const int (&xoff)[kTiles], int tiles, int b, int n_kb) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int kb = b * kU + u;
    if (kb >= n_kb) break;
    const uint32_t a0[4] = {r[u][0].x, r[u][1].x, r[u][0].y, r[u][1].y};
    const uint32_t a1[4] = {r[u][0].z, r[u][1].z, r[u][0].w, r[u][1].w};
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      if (j < tiles) {
        const uint4 xv = ld_xrow<kShared>(xc + xoff[j] + kb * kBlockK);
        mma16816<T>(acc[j], a0, xv.x, xv.y);
        mma16816<T>(acc[j], a1, xv.z, xv.w);
      }
    }
  }
}

// x rows of a pass in shared memory: row m of K elements at m * (K + kXPad); the pad (64 bytes) puts the two
// rows that one phase of a 16-byte shared load reads (lanes g, g + 1) in different banks.
constexpr int kXPad = 32;

template <typename T>
__host__ __device__ constexpr int64_t x_rows_bytes(int rows, int K) {
  return int64_t(rows) * (K + kXPad) * sizeof(T);
}

// Issues the copies of the n rows src(m) of K elements into xs (cp.async, all threads, one commit group); the
// caller waits for them (cp_async_wait<0>, then __syncthreads for every thread's).
template <typename T, class Src>
__device__ __forceinline__ void stage_x(T* xs, const Src& src, int n, int K) {
  const int chunks = K / 8;
  for (int c = threadIdx.x; c < n * chunks; c += kThreads) {
    const int m = c / chunks, q = c % chunks;
    cp_async16(xs + m * (K + kXPad) + 8 * q, src(m) + 8 * q, 16);
  }
  cp_async_commit();
}

// One pass: the warp's 16 x 8 NT fp32 tile over its K range, then the CTA's KW slices into shared memory as
// red[wk][m][col] (col = 16 wr + A-fragment row). Caller syncs before reading. C::kSmemX: `stage` issues the
// copies of the pass's x rows to shared memory, and they complete while the first two weight batches load.
template <typename T, class C, class Stage>
__device__ __forceinline__ void pass_tile(const Stream<T>& s, const T* xc, const int (&xoff)[C::NT], int tiles,
                                          float* red, uint64_t pol, const Stage& stage) {
  constexpr int kTiles = C::NT, kU = C::U, kPassRows = C::kRows, kStride = C::kStride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wr = warp % C::RW, wk = warp / C::RW;
  float acc[kTiles][4];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  uint4 ra[kU][2], rb[kU][2];
  const int n_batches = (s.n_kb + kU - 1) / kU;
  if constexpr (C::kSmemX) stage();
  load_batch<T, kU>(ra, s, 0, pol);
  load_batch<T, kU>(rb, s, 1, pol);
  if constexpr (C::kSmemX) {
    cp_async_wait<0>();
    __syncthreads();
  }
  for (int b = 0; b < n_batches; b += 2) {
    compute_batch<T, kTiles, kU, C::kSmemX>(acc, ra, xc, xoff, tiles, b, s.n_kb);
    if (b + 2 < n_batches) load_batch<T, kU>(ra, s, b + 2, pol);
    if (b + 1 < n_batches) compute_batch<T, kTiles, kU, C::kSmemX>(acc, rb, xc, xoff, tiles, b + 1, s.n_kb);
    if (b + 3 < n_batches) load_batch<T, kU>(rb, s, b + 3, pol);
  }
  // d0/d1: A-row g, x rows 8j + 2t / + 1; d2/d3: A-row g + 8.
  float* mine = red + wk * kPassRows * kStride;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      mine[(8 * j + 2 * t + (e & 1)) * kStride + wr * 16 + g + 8 * (e >> 1)] = acc[j][e];
}

template <class C>
__device__ __forceinline__ float slice_sum(const float* red, int m, int col) {
  float v = 0.f;
#pragma unroll
  for (int q = 0; q < C::KW; ++q) v += red[(q * C::kRows + m) * C::kStride + col];
  return v;
}

// The warp's k32-block range: part wk of KW contiguous ranges of K / kBlockK blocks.
template <class C>
__device__ __forceinline__ void k_range(int K, int& kb0, int& n_kb) {
  const int wk = (threadIdx.x / 32) / C::RW, total = K / kBlockK;
  kb0 = wk * total / C::KW;
  n_kb = (wk + 1) * total / C::KW - kb0;
}

template <typename T, class C>
__global__ void __launch_bounds__(kThreads, 2)
    moe_gate_up_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w13,
                       const int32_t* __restrict__ order, const int32_t* __restrict__ offsets,
                       const int32_t* __restrict__ active, int k, int E, int H, int I, T* __restrict__ act) {
  constexpr int NT = C::NT, kPassRows = C::kRows, kCols = 8 * C::RW;  // gate (and up) columns of the CTA
  __shared__ __align__(16) float red[C::kSmemFloats];
  extern __shared__ __align__(16) unsigned char dyn[];  // C::kSmemX: the pass's x rows
  pdl_enter();  // the routing (previous kernel) decides which weights to read, so nothing moves before it ends
  T* xs = reinterpret_cast<T*>(dyn);
  if (static_cast<int>(blockIdx.y) >= active[E]) return;
  const int e = active[blockIdx.y], row0 = offsets[e], rows = offsets[e + 1] - row0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wr = warp % C::RW, c0 = blockIdx.x * kCols;
  int kb0, n_kb;
  k_range<C>(H, kb0, n_kb);
  const T* we = w13 + static_cast<int64_t>(e) * 2 * I * H + kb0 * kBlockK + 8 * t;
  const Stream<T> s{we + static_cast<int64_t>(c0 + wr * 8 + g) * H,  // gate row
                    we + static_cast<int64_t>(I + c0 + wr * 8 + g) * H, n_kb};  // the matching up row
  const uint64_t pol = evict_first_policy();
  for (int p0 = 0; p0 < rows; p0 += kPassRows) {
    const int n = min(kPassRows, rows - p0), tiles = (n + 7) / 8;
    int xoff[NT];
    const T* xc;
    if constexpr (C::kSmemX) {
#pragma unroll
      for (int j = 0; j < NT; ++j) xoff[j] = min(8 * j + g, n - 1) * (H + kXPad);
      xc = xs + kb0 * kBlockK + 8 * t;
    } else {
#pragma unroll
      for (int j = 0; j < NT; ++j) xoff[j] = order[row0 + p0 + min(8 * j + g, n - 1)] / k * static_cast<int>(ldx);
      xc = x + kb0 * kBlockK + 8 * t;
    }
    const auto row_of = [&](int m) { return x + static_cast<int64_t>(order[row0 + p0 + m] / k) * ldx; };
    pass_tile<T, C>(s, xc, xoff, tiles, red, pol, [&] { stage_x(xs, row_of, n, H); });
    __syncthreads();
    // (m, pair of gate columns c, c + 1): SwiGLU of the K-summed gate and up, one 4-byte store.
    for (int i = threadIdx.x; i < n * (kCols / 2); i += kThreads) {
      const int m = i / (kCols / 2), c = 2 * (i % (kCols / 2));
      float out[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = (c + h) / 8 * 16 + (c + h) % 8;  // A-row (c + h) % 8 of row warp (c + h) / 8
        const float gate = slice_sum<C>(red, m, col), up = slice_sum<C>(red, m, col + 8);
        out[h] = gate / (1.f + expf(-gate)) * up;
      }
      *reinterpret_cast<uint32_t*>(act + static_cast<int64_t>(row0 + p0 + m) * I + c0 + c) =
          DType<T>::from_float2(out[0], out[1]);
    }
    __syncthreads();  // red is reused by the next pass
  }
}

template <typename T, class C>
__global__ void __launch_bounds__(kThreads, 2)
    moe_down_kernel(const T* __restrict__ act, const T* __restrict__ w2, const float* __restrict__ weights,
                    const int32_t* __restrict__ order, const int32_t* __restrict__ offsets,
                    const int32_t* __restrict__ active, int E, int H, int I, float* __restrict__ pairs) {
  constexpr int NT = C::NT, kPassRows = C::kRows, kCols = 16 * C::RW;  // output columns of the CTA
  __shared__ __align__(16) float red[C::kSmemFloats];
  extern __shared__ __align__(16) unsigned char dyn[];  // C::kSmemX: the pass's act rows
  pdl_enter();
  T* xs = reinterpret_cast<T*>(dyn);
  if (static_cast<int>(blockIdx.y) >= active[E]) return;
  const int e = active[blockIdx.y], row0 = offsets[e], rows = offsets[e + 1] - row0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wr = warp % C::RW, n0 = blockIdx.x * kCols;
  int kb0, n_kb;
  k_range<C>(I, kb0, n_kb);
  const T* we = w2 + static_cast<int64_t>(e) * H * I + kb0 * kBlockK + 8 * t;
  const Stream<T> s{we + static_cast<int64_t>(n0 + wr * 16 + g) * I,
                    we + static_cast<int64_t>(n0 + wr * 16 + g + 8) * I, n_kb};
  const uint64_t pol = evict_first_policy();
  for (int p0 = 0; p0 < rows; p0 += kPassRows) {
    const int n = min(kPassRows, rows - p0), tiles = (n + 7) / 8;
    int xoff[NT];
    const int ld = C::kSmemX ? I + kXPad : I, first = C::kSmemX ? 0 : row0 + p0;
#pragma unroll
    for (int j = 0; j < NT; ++j) xoff[j] = (first + min(8 * j + g, n - 1)) * ld;
    const T* xc = (C::kSmemX ? xs : act) + kb0 * kBlockK + 8 * t;
    const auto row_of = [&](int m) { return act + static_cast<int64_t>(row0 + p0 + m) * I; };
    pass_tile<T, C>(s, xc, xoff, tiles, red, pol, [&] { stage_x(xs, row_of, n, I); });
    __syncthreads();
    for (int i = threadIdx.x; i < n * (kCols / 4); i += kThreads) {
      const int m = i / (kCols / 4), c = 4 * (i % (kCols / 4));
      const int q = order[row0 + p0 + m];
      const float wq = weights[q];
      float4 v;
      v.x = wq * slice_sum<C>(red, m, c);
      v.y = wq * slice_sum<C>(red, m, c + 1);
      v.z = wq * slice_sum<C>(red, m, c + 2);
      v.w = wq * slice_sum<C>(red, m, c + 3);
      *reinterpret_cast<float4*>(pairs + static_cast<int64_t>(q) * H + n0 + c) = v;
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void moe_combine_kernel(const float* __restrict__ pairs, int k, int H, T* __restrict__ y,
                                   int64_t ldy) {
  pdl_enter();
  const int t = blockIdx.y;
  const int c = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= H) return;
  const float* p = pairs + static_cast<int64_t>(t) * k * H + c;
  float4 s = *reinterpret_cast<const float4*>(p);
  for (int j = 1; j < k; ++j) {  // slot order, every time: deterministic
    const float4 v = *reinterpret_cast<const float4*>(p + static_cast<int64_t>(j) * H);
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
  }
  uint2 out;
  out.x = DType<T>::from_float2(s.x, s.y);
  out.y = DType<T>::from_float2(s.z, s.w);
  *reinterpret_cast<uint2*>(y + static_cast<int64_t>(t) * ldy + c) = out;
}

// ---- down with the combine in, for a few tokens ---------------------------------------------------------------

constexpr int kDcCols = kMoeDownCombineCols;  // output columns per CTA (hidden is a multiple), or half of them
constexpr int kDcRows = 8;                    // weight rows per warp job: 8 16-byte loads per lane per batch

template <typename T, int R>
__device__ __forceinline__ void load_rows(uint4 (&r)[R], const T* w, int I, int i, uint64_t pol) {
  if (i >= I) return;
#pragma unroll
  for (int j = 0; j < R; ++j) r[j] = ld_weight(w + static_cast<int64_t>(j) * I + i, pol);
}

template <typename T, int R>
__device__ __forceinline__ void fma_rows(float (&acc)[R], const uint4 (&r)[R], const T* a, int i) {
  float af[8];
  unpack8<T>(ld_x(a + i), af);
#pragma unroll
  for (int j = 0; j < R; ++j) {
    float wf[8];
    unpack8<T>(r[j], wf);
#pragma unroll
    for (int m = 0; m < 8; ++m) acc[j] = fmaf(wf[m], af[m], acc[j]);
  }
}

// acc[j] = (weight row j of w) . a over I, on every lane of the warp: lane l takes the 8-element chunks at
// 8 l + 256 m, with the next chunk's loads in flight while one is summed (two register batches, as pass_tile).
template <typename T, int R>
__device__ __forceinline__ void warp_dot_rows(float (&acc)[R], const T* w, const T* a, int I, uint64_t pol) {
#pragma unroll
  for (int j = 0; j < R; ++j) acc[j] = 0.f;
  uint4 ra[R], rb[R];
  const int i0 = 8 * (threadIdx.x % 32);
  load_rows<T, R>(ra, w, I, i0, pol);
  load_rows<T, R>(rb, w, I, i0 + 256, pol);
  for (int i = i0; i < I; i += 512) {
    fma_rows<T, R>(acc, ra, a, i);
    load_rows<T, R>(ra, w, I, i + 512, pol);
    if (i + 256 < I) fma_rows<T, R>(acc, rb, a, i + 256);
    load_rows<T, R>(rb, w, I, i + 768, pol);
  }
#pragma unroll
  for (int j = 0; j < R; ++j) acc[j] = warp_sum_xor(acc[j], 1, 32);
}

// CTA (token t = blockIdx.x, columns n0 + [0, kCols)): warp jobs of kDcRows columns of one slot, slot-major;
// each writes weight * dot per (slot, column) to shared memory, then the slots are summed in order. Tokens are
// the grid's fast index, so the CTAs of tokens that share an expert read its rows close in time (from L2).
template <typename T, int kCols>
__global__ void __launch_bounds__(kThreads, 2)
    moe_down_combine_kernel(const T* __restrict__ act, const T* __restrict__ w2, const int32_t* __restrict__ ids,
                            const float* __restrict__ weights, const int32_t* __restrict__ order, int k, int H,
                            int I, T* __restrict__ y, int64_t ldy) {
  constexpr int kGroups = kCols / kDcRows;
  __shared__ int act_row[kMoeMaxTopK];           // the row of act that holds pair (t, s)
  __shared__ float part[kMoeMaxTopK][kCols];
  pdl_enter();
  const int t = blockIdx.x, n0 = blockIdx.y * kCols, warp = threadIdx.x / 32;
  for (int p = threadIdx.x; p < static_cast<int>(gridDim.x) * k; p += kThreads) {  // invert order for token t
    const int q = order[p];
    if (q / k == t) act_row[q - t * k] = p;
  }
  __syncthreads();
  const uint64_t pol = evict_first_policy();
  for (int job = warp; job < k * kGroups; job += kWarps) {
    const int s = job / kGroups, c0 = job % kGroups * kDcRows, q = t * k + s;
    float acc[kDcRows];
    warp_dot_rows<T, kDcRows>(acc, w2 + (static_cast<int64_t>(ids[q]) * H + n0 + c0) * I,
                              act + static_cast<int64_t>(act_row[s]) * I, I, pol);
    if (threadIdx.x % 32 == 0) {
      const float wq = weights[q];
#pragma unroll
      for (int j = 0; j < kDcRows; ++j) part[s][c0 + j] = wq * acc[j];
    }
  }
  __syncthreads();
  if (threadIdx.x < kCols / 2) {  // slot order, every time: deterministic
    const int c = 2 * threadIdx.x;
    float v0 = part[0][c], v1 = part[0][c + 1];
    for (int s = 1; s < k; ++s) {
      v0 += part[s][c];
      v1 += part[s][c + 1];
    }
    *reinterpret_cast<uint32_t*>(y + static_cast<int64_t>(t) * ldy + n0 + c) = DType<T>::from_float2(v0, v1);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Experts a step can touch: at most T * k of the E, so the grid's y extent stays small at B = 1.
int expert_slots(int T, int k, int E) { return static_cast<int>(std::min<int64_t>(E, int64_t(T) * k)); }

bool gemm_ok(int T, int k, int E, int H, int I) {
  return T >= 0 && k >= 1 && k <= kMoeMaxTopK && E >= 1 && E <= kMoeMaxExperts && H > 0 && I > 0 &&
         int64_t(T) * k * std::max(H, I) < (int64_t(1) << 31);
}

// x tiles per pass (NT), fixed by the step's sizes alone (graph-safe). An expert has at most T rows (a token
// picks an expert once): T <= 8 needs one n8 tile, T <= 16 two. Above, two while the mean rows per expert T k / E
// is at most 8 (16 rows is then nearly 3 standard deviations above it under uniform routing: Qwen3-30B-A3B at
// B = 128 has 8 on average), else four. Two tiles keep twice the weight bytes in flight per warp (batch_blocks),
// and their x rows fit in shared memory (smem_x_fits); an expert with more rows than a pass takes more passes
// (correct, and rare). Measured on the H200 (scripts/moe_bench.py, one Qwen3-30B-A3B layer, d355453): two tiles
// at 128 tokens 362 us against 416 with four; at 256 tokens (16 rows on average, many experts in two passes)
// 513-521 against 462.
int pass_tiles(int T, int k, int E) {
  if (T <= 8) return 1;
  return T <= 16 || int64_t(T) * k <= int64_t(8) * E ? 2 : 4;
}

template <template <typename, int> class Launch, typename... Args>
cudaError_t by_tiles(int nt, ScalarType dtype, Args... args) {
  const bool half = dtype == ScalarType::kFloat16;
  if (dtype != ScalarType::kBFloat16 && !half) return cudaErrorInvalidValue;
  if (nt == 1) return half ? Launch<__half, 1>::run(args...) : Launch<__nv_bfloat16, 1>::run(args...);
  if (nt == 2) return half ? Launch<__half, 2>::run(args...) : Launch<__nv_bfloat16, 2>::run(args...);
  return half ? Launch<__half, 4>::run(args...) : Launch<__nv_bfloat16, 4>::run(args...);
}

// gate_up with one row warp (8 gate columns per CTA, K over 8 warps) where a step touches few experts (T <= 8):
// twice the CTAs of the two-row-warp tile, so the few experts' weights spread over every SM (Qwen3-30B-A3B at
// B = 1: 768 CTAs instead of 384 for 264 resident slots, 2.9 waves instead of 1.45).
bool gate_up_one_row_warp(int T, int H) { return T <= 8 && H / kBlockK >= 8; }

// Whether tile C's CTAs can hold their pass's x rows (K elements each) in shared memory and still fit two an SM
// (the launch bounds' occupancy, which keeps enough weight bytes in flight). Gate_up at four x tiles (Qwen3-30B-A3B:
// 135 KB) does not.
template <typename T, class C>
bool smem_x_fits(int K) {
  constexpr int64_t kReserved = 1024;  // per CTA, the driver's
  const int64_t per_cta = x_rows_bytes<T>(C::kRows, K) + int64_t(C::kSmemFloats) * 4;  // dynamic + static
  return 2 * (per_cta + kReserved) <= current_smem_per_sm() && per_cta <= current_smem_optin();
}

// kernel<Tile<NT, RW, true>> with the pass's x rows in dynamic shared memory where they fit, else
// kernel<Tile<NT, RW>> reading x from global memory.
template <template <typename, class> class Kernel, typename T, int NT, int RW, typename... Args>
cudaError_t launch_tile(int K, dim3 grid, cudaStream_t stream, Args... args) {
  using Staged = Tile<NT, RW, true>;
  if (smem_x_fits<T, Staged>(K)) {
    const int64_t bytes = x_rows_bytes<T>(Staged::kRows, K);
    const cudaError_t opt_in =
        cudaFuncSetAttribute(Kernel<T, Staged>::fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (opt_in != cudaSuccess) return opt_in;
    return launch_kernel(Kernel<T, Staged>::fn, grid, dim3(kThreads), bytes, stream, args...);
  }
  return launch_kernel(Kernel<T, Tile<NT, RW>>::fn, grid, dim3(kThreads), 0, stream, args...);
}

template <typename T, class C>
struct GateUpKernel {
  static constexpr auto fn = moe_gate_up_kernel<T, C>;
};
template <typename T, class C>
struct DownKernel {
  static constexpr auto fn = moe_down_kernel<T, C>;
};

template <typename T, int NT>
struct GateUp {
  static cudaError_t run(int rw, int cols, int slots, cudaStream_t stream, const void* x, int64_t ldx,
                         const void* w13, const int32_t* order, const int32_t* offsets, const int32_t* active, int k,
                         int E, int H, int I, void* act) {
    auto tile = launch_tile<GateUpKernel, T, NT, 2, const T*, int64_t, const T*, const int32_t*, const int32_t*,
                            const int32_t*, int, int, int, int, T*>;
    if constexpr (NT == 1) {
      if (rw == 1)
        tile = launch_tile<GateUpKernel, T, 1, 1, const T*, int64_t, const T*, const int32_t*, const int32_t*,
                           const int32_t*, int, int, int, int, T*>;
    }
    return tile(H, dim3(cols / (8 * rw), slots), stream, static_cast<const T*>(x), ldx, static_cast<const T*>(w13),
                order, offsets, active, k, E, H, I, static_cast<T*>(act));
  }
};

template <typename T, int NT>
struct Down {
  static cudaError_t run(dim3 grid, cudaStream_t stream, const void* act, const void* w2, const float* weights,
                         const int32_t* order, const int32_t* offsets, const int32_t* active, int E, int H, int I,
                         float* pairs) {
    return launch_tile<DownKernel, T, NT, 2>(I, grid, stream, static_cast<const T*>(act), static_cast<const T*>(w2),
                                             weights, order, offsets, active, E, H, I, pairs);
  }
};

template <typename T, int kCols>
struct DownCombine {
  static cudaError_t run(cudaStream_t stream, const void* act, const void* w2, const int32_t* ids, const float* weights,
                         const int32_t* order, int tokens, int k, int H, int I, void* y, int64_t ldy) {
    return launch_kernel(moe_down_combine_kernel<T, kCols>, dim3(tokens, H / kCols), dim3(kThreads), 0, stream,
                         static_cast<const T*>(act), static_cast<const T*>(w2), ids, weights, order, k, H, I,
                         static_cast<T*>(y), ldy);
  }
};

template <template <typename, int> class Launch, int N, typename... Args>
cudaError_t by_dtype(ScalarType dtype, Args... args) {
  if (dtype == ScalarType::kBFloat16) return Launch<__nv_bfloat16, N>::run(args...);
  if (dtype == ScalarType::kFloat16) return Launch<__half, N>::run(args...);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_moe_gate_up(const void* x, int64_t ldx, const void* w13, const int32_t* order,
                               const int32_t* offsets, const int32_t* active, int T, int k, int E, int H, int I,
                               void* act, ScalarType dtype, cudaStream_t stream) {
  if (!gemm_ok(T, k, E, H, I) || H % kMoeTileK || H / kMoeTileK < kMoeKWarps || I % kMoeGateCols || ldx % 8 ||
      ldx < H || int64_t(T) * ldx >= (int64_t(1) << 31) || !aligned16(x) || !aligned16(w13) ||
      reinterpret_cast<uintptr_t>(act) % 4)
    return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const int rw = gate_up_one_row_warp(T, H) ? 1 : 2;
  return by_tiles<GateUp>(pass_tiles(T, k, E), dtype, rw, I, expert_slots(T, k, E), stream, x, ldx, w13, order,
                          offsets, active, k, E, H, I, act);
}

cudaError_t launch_moe_down(const void* act, const void* w2, const float* weights, const int32_t* order,
                            const int32_t* offsets, const int32_t* active, int T, int k, int E, int H, int I,
                            float* pairs, ScalarType dtype, cudaStream_t stream) {
  if (!gemm_ok(T, k, E, H, I) || I % kMoeTileK || I / kMoeTileK < kMoeKWarps || H % kMoeDownCols ||
      !aligned16(act) || !aligned16(w2) || !aligned16(pairs))
    return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const dim3 grid(H / kMoeDownCols, expert_slots(T, k, E));
  return by_tiles<Down>(pass_tiles(T, k, E), dtype, grid, stream, act, w2, weights, order, offsets, active, E, H, I,
                        pairs);
}

cudaError_t launch_moe_combine(const float* pairs, int T, int k, int H, void* y, int64_t ldy, ScalarType dtype,
                               cudaStream_t stream) {
  if (T < 0 || T > 65535 || k < 1 || k > kMoeMaxTopK || H <= 0 || H % 4 || ldy % 4 || ldy < H ||
      !aligned16(pairs) || reinterpret_cast<uintptr_t>(y) % 8)
    return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const int threads = 128;
  const dim3 grid((H / 4 + threads - 1) / threads, T);
  if (dtype == ScalarType::kBFloat16)
    return launch_kernel(moe_combine_kernel<__nv_bfloat16>, grid, dim3(threads), 0, stream, pairs, k, H,
                         static_cast<__nv_bfloat16*>(y), ldy);
  if (dtype == ScalarType::kFloat16)
    return launch_kernel(moe_combine_kernel<__half>, grid, dim3(threads), 0, stream, pairs, k, H,
                         static_cast<__half*>(y), ldy);
  return cudaErrorInvalidValue;
}

cudaError_t launch_moe_down_combine(const void* act, const void* w2, const int32_t* ids, const float* weights,
                                    const int32_t* order, int T, int k, int E, int H, int I, void* y, int64_t ldy,
                                    ScalarType dtype, cudaStream_t stream) {
  if (!gemm_ok(T, k, E, H, I) || I % 8 || H % kDcCols || H / kDcCols > 65535 || ldy % 2 || ldy < H ||
      !aligned16(act) || !aligned16(w2) || reinterpret_cast<uintptr_t>(y) % 4)
    return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  // Half-width CTAs where full-width ones would leave SMs with one CTA (Qwen3-30B-A3B at B = 1: 128 CTAs of two
  // jobs a warp, against 256 of one): every warp's loads are then in flight from its start.
  const int sms = current_sm_count();
  return int64_t(T) * (H / kDcCols) <= sms
             ? by_dtype<DownCombine, kDcCols / 2>(dtype, stream, act, w2, ids, weights, order, T, k, H, I, y, ldy)
             : by_dtype<DownCombine, kDcCols>(dtype, stream, act, w2, ids, weights, order, T, k, H, I, y, ldy);
}

}  // namespace minillm
