// Paged prefill attention, wide variant: 128 query rows per CTA of 4 warps, 32 rows per warp (two m16 tiles).
//
// Same contract, fragment layouts and K/V pipeline as paged_prefill.cu (cp.async through the block table into
// double-buffered swizzled tiles of 64 keys, mma.sync m16n8k16, fp32 online softmax), with these differences:
// - Every K and V fragment read from shared memory feeds both of a warp's m16 tiles. With 16 rows per warp
//   (paged_prefill.cu) one 512-byte ldmatrix.x4 feeds 2 mma, which asks more of shared memory (128 B/clock per
//   SM) than the tensor cores take; with 32 rows it feeds 4.
// - Each K/V tile serves 128 queries, halving the L2 -> shared traffic and the cp.async issue per FLOP.
// - Head dim 128 reads Q's A fragments from shared memory per k-step (32 rows of Q in registers would leave too
//   few for the 128 fp32 output accumulators); head dim 64 keeps Q in registers.
// - Causal: a warp skips the math (not the barriers) of a tile none of its rows can see, and masks only tiles
//   that reach past its first row. The query-tile index is the grid's slowest dimension, reversed, so every
//   head's longest tiles are scheduled first and the CTAs of the heads sharing a KV head run together.
// - exp2 is one ex2.approx.ftz (exp2f adds denormal handling around it).
// Keys past a tile's reach are zero-filled, never read (unowned cache slots may hold NaN), and masked with -inf
// before the softmax, so they enter P V as exact zeros. Native caches only; fp8 caches stay on paged_prefill.cu.
#include <math_constants.h>

#include "attention.h"
#include "common.cuh"
#include "launch.h"
#include "prefill_tiles.cuh"

namespace minillm {
namespace {

constexpr int kBM = 128;  // query rows per CTA
constexpr int kBN = 64;   // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kWarpRows = kBM / kWarps;  // 32: two m16 tiles
constexpr int kMT = kWarpRows / 16;

template <int D>
constexpr int smem_bytes() { return (kBM + 4 * kBN) * D * 2; }  // Q + 2 stages of K and V, 2-byte elements

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2)
    paged_prefill_wide_kernel(PagedAttnArgs a, const int* __restrict__ qsl, int seq_begin) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  constexpr int CH = D / 8, KS = D / 16, NT = kBN / 8, DT = D / 8;
  constexpr bool kQInRegs = D <= 64;
  using TC = TileCopy<D, kThreads, kBN>;
  extern __shared__ uint4 smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBM * D;
  T* sV = sK + 2 * kBN * D;

  const int h = blockIdx.x, s = seq_begin + blockIdx.y;
  const int q0 = qsl[s], qlen = qsl[s + 1] - q0, ctx = a.seq_lens[s];
  const int m0 = (gridDim.z - 1 - blockIdx.z) * kBM;  // late (heavy, causal) tiles are scheduled first
  if (m0 >= qlen) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = h / (a.num_q_heads / a.num_kv_heads);
  const int pos0 = ctx - qlen;                     // position of query row 0
  const int n_end = min(ctx, pos0 + m0 + kBM);     // keys visible to the last row of this tile
  const int n_tiles = (n_end + kBN - 1) / kBN;
  const int64_t tok_stride = (int64_t)a.num_kv_heads * D;
  const int* bt = a.block_tables + s * a.bt_stride;
  const T* kc = static_cast<const T*>(a.k_cache) + kvh * D;
  const T* vc = static_cast<const T*>(a.v_cache) + kvh * D;

  load_q_tile<T, D, kBM, kThreads>(sQ, a, h, q0, m0, qlen);  // rows past qlen: zero-filled
  const int cr0 = threadIdx.x / CH, cc = threadIdx.x % CH;  // this thread's rows and column in tile copies
  const int bs_log2 = __ffs(a.block_size) - 1;
  int slot[TC::ROWS];
  tile_slots<D, kThreads, kBN>(slot, bt, bs_log2, 0, n_end, cr0);
  load_kv_tile<T, D, kThreads, kBN>(sK, kc, slot, tok_stride, cr0, cc);
  cp_async_commit();  // Q and K_0
  load_kv_tile<T, D, kThreads, kBN>(sV, vc, slot, tok_stride, cr0, cc);
  cp_async_commit();  // V_0
  if (n_tiles > 1) tile_slots<D, kThreads, kBN>(slot, bt, bs_log2, kBN, n_end, cr0);
  cp_async_wait<1>();
  __syncthreads();

  const int wrow0 = warp * kWarpRows;  // this warp's first row in the tile
  uint32_t qreg[kQInRegs ? kMT : 1][kQInRegs ? KS : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        ldmatrix_x4(qreg[mt][ks], sQ + swz<CH>(wrow0 + mt * 16 + (lane & 15), 2 * ks + (lane >> 4)));
  }

  float o[kMT][DT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
  float mrow[kMT][2], lrow[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) mrow[mt][0] = mrow[mt][1] = -CUDART_INF_F, lrow[mt][0] = lrow[mt][1] = 0.f;
  const float sl2 = a.scale * kLog2e;
  const int wpos0 = pos0 + m0 + wrow0;             // position of this warp's first row
  const int row_pos0 = wpos0 + lane / 4;           // position of this thread's first row (m tile 0, r 0)
  const bool has_rows = m0 + wrow0 < qlen;         // a warp of padding rows only computes nothing

  for (int j = 0; j < n_tiles; ++j) {
    const T* sKj = sK + (j & 1) * kBN * D;
    const T* sVj = sV + (j & 1) * kBN * D;
    if (j > 0) {
      cp_async_wait<1>();  // K_j landed (V_j may still be in flight)
      __syncthreads();
    }
    // Every warp finished tile j-1 before the barrier above, so the other K stage is free to refill.
    if (j + 1 < n_tiles) load_kv_tile<T, D, kThreads, kBN>(sK + ((j + 1) & 1) * kBN * D, kc, slot, tok_stride, cr0, cc);
    cp_async_commit();  // an empty group at the end keeps the wait counts uniform

    // Warp-uniform: the warp has a query row and its last row reaches the tile's first key. A skipped tile would
    // change nothing: all its scores are masked.
    const bool visible = has_rows && j * kBN <= wpos0 + kWarpRows - 1;
    float sc[kMT][NT][4];
    if (visible) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int i = 0; i < NT; ++i) sc[mt][i][0] = sc[mt][i][1] = sc[mt][i][2] = sc[mt][i][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t qa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if constexpr (kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[mt][e] = qreg[mt][ks][e];
          } else {
            ldmatrix_x4(qa[mt], sQ + swz<CH>(wrow0 + mt * 16 + (lane & 15), 2 * ks + (lane >> 4)));
          }
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, sKj + swz<CH>(np * 16 + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma16816<T>(sc[mt][2 * np], qa[mt], b[0], b[1]);
            mma16816<T>(sc[mt][2 * np + 1], qa[mt], b[2], b[3]);
          }
        }
      }

      // Causal mask (and keys past the context, zero-filled above), only on tiles that reach past the warp's
      // first row.
      if (j * kBN + kBN - 1 > wpos0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = j * kBN + nt * 8 + (lane % 4) * 2 + (e & 1);
              if (key > row_pos0 + mt * 16 + (e >> 1) * 8) sc[mt][nt][e] = -CUDART_INF_F;
            }
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        online_softmax_row<NT, DT, true>(sc[mt], o[mt], mrow[mt][0], lrow[mt][0], sl2, 0);
        online_softmax_row<NT, DT, true>(sc[mt], o[mt], mrow[mt][1], lrow[mt][1], sl2, 1);
      }
    }

    cp_async_wait<1>();  // V_j landed (K_{j+1} may still be in flight)
    __syncthreads();
    if (j + 1 < n_tiles) load_kv_tile<T, D, kThreads, kBN>(sV + ((j + 1) & 1) * kBN * D, vc, slot, tok_stride, cr0, cc);
    cp_async_commit();
    if (j + 2 < n_tiles) tile_slots<D, kThreads, kBN>(slot, bt, bs_log2, (j + 2) * kBN, n_end, cr0);  // during P*V

    if (visible) {
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        // The S accumulator layout of two adjacent n-tiles is exactly the A fragment of one k-step.
        uint32_t pa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          pa[mt][0] = DType<T>::from_float2(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
          pa[mt][1] = DType<T>::from_float2(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
          pa[mt][2] = DType<T>::from_float2(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
          pa[mt][3] = DType<T>::from_float2(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sVj + swz<CH>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, 2 * dp + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma16816<T>(o[mt][2 * dp], pa[mt], b[0], b[1]);
            mma16816<T>(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = warp_sum_xor(lrow[mt][r], 1, 4);
      const int row = m0 + wrow0 + mt * 16 + lane / 4 + r * 8;
      if (row >= qlen) continue;
      const float inv = 1.f / l;
      T* op = static_cast<T*>(a.out) + (int64_t)(q0 + row) * a.out_stride_t + h * a.out_stride_h + (lane % 4) * 2;
#pragma unroll
      for (int i = 0; i < DT; ++i)
        *reinterpret_cast<uint32_t*>(op + i * 8) =
            DType<T>::from_float2(o[mt][i][2 * r] * inv, o[mt][i][2 * r + 1] * inv);
    }
}

template <typename T, int D>
cudaError_t launch_typed(const PagedAttnArgs& a, const int* qsl, int seq_begin, int max_query_len,
                         cudaStream_t stream) {
  constexpr int smem = smem_bytes<D>();
  // Above 48 KB of dynamic shared memory a kernel must opt in; once per instantiation is enough.
  static const cudaError_t attr = cudaFuncSetAttribute(paged_prefill_wide_kernel<T, D>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  const int q_tiles = (max_query_len + kBM - 1) / kBM;
  if (a.num_seqs > 65535 || q_tiles > 65535) return cudaErrorInvalidValue;  // grid y / z limits
  const dim3 grid(a.num_q_heads, a.num_seqs, q_tiles);
  return launch_kernel(paged_prefill_wide_kernel<T, D>, grid, dim3(kThreads), smem, stream, a, qsl, seq_begin);
}

}  // namespace

cudaError_t launch_paged_prefill_wide(const PagedAttnArgs& a, const int* query_start_loc, int seq_begin,
                                      int max_query_len, cudaStream_t stream) {
  if (!prefill_args_valid(a, max_query_len)) return cudaErrorInvalidValue;
  if (a.num_seqs == 0 || max_query_len == 0) return cudaSuccess;
  const bool bf16 = a.dtype == ScalarType::kBFloat16;
  if (a.head_dim == 128)
    return bf16 ? launch_typed<__nv_bfloat16, 128>(a, query_start_loc, seq_begin, max_query_len, stream)
                : launch_typed<__half, 128>(a, query_start_loc, seq_begin, max_query_len, stream);
  if (a.head_dim == 64)
    return bf16 ? launch_typed<__nv_bfloat16, 64>(a, query_start_loc, seq_begin, max_query_len, stream)
                : launch_typed<__half, 64>(a, query_start_loc, seq_begin, max_query_len, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
