// Paged prefill attention on tensor cores (FlashAttention-2 style), causal, for ragged batches.
//
// One launch covers every prefill sequence: grid (query tiles, q heads, sequences). A CTA of 4 warps owns
// 64 query rows of one head (16 per warp, kept in registers as mma A fragments) and walks 64-key tiles of
// its sequence's context, read straight from the paged cache through the block table with cp.async into
// double-buffered, XOR-swizzled shared memory (the next K tile streams in during QK^T softmax, the next V tile
// during P*V). S = QK^T and O += PV run on mma.sync m16n8k16 with fp32 accumulators; softmax is online in
// fp32 (exp2, scale folded in). Query i of a sequence sits at position seq_len - query_len + i, so prefix-cache
// hits and later chunks of a chunked prefill attend to the cached keys before them with no special case.
// Keys past what a tile can see are zero-filled, never read: unowned cache slots may hold NaN.
// Variants: head dim 64 and 128, bf16 and fp16; any power-of-two block size (runtime), GQA by kv head = q head / group.
// An fp8 cache (CF, kv_fp8.cuh): K and V tiles stream in as fp8 bytes into their own double buffer; once a tile
// has landed, each thread widens the pieces it copied itself (exact) into the 2-byte tile the mma code reads, before
// the barrier that code already has. K scale in the fp32 softmax scale, V scale on the fp32 output: P V stays a
// bf16/fp16 mma with fp32 accumulation.
#include <math_constants.h>

#include <type_traits>

#include "attention.h"
#include "common.cuh"
#include "kv_fp8.cuh"
#include "prefill_tiles.cuh"
#include "launch.h"

namespace minillm {
namespace {

constexpr int kBM = 64;  // query rows per CTA
constexpr int kBN = 64;  // keys per tile
constexpr int kThreads = 128;

template <int D>
constexpr int smem_bytes() { return (kBM + 4 * kBN) * D * 2; }  // Q + 2 stages of K and V, 2-byte elements

template <int D>
using TileCopyN = TileCopy<D, kThreads, kBN>;

// fp8 tiles: 16-byte pieces of 16 elements, unswizzled rows of D bytes.
template <int D>
struct TileCopy8 {
  static constexpr int CH = D / 16, PASS = kThreads / CH, ROWS = kBN / PASS;
};

template <int D>
constexpr int smem_bytes_fp8() { return smem_bytes<D>() + 4 * kBN * D; }  // + 2 stages of fp8 K and V

template <int D>
__device__ __forceinline__ void tile_slots8(int (&slot)[TileCopy8<D>::ROWS], const int* bt, int bs_log2, int n0,
                                            int n_end, int r0) {
#pragma unroll
  for (int i = 0; i < TileCopy8<D>::ROWS; ++i) {
    const int pos = n0 + r0 + i * TileCopy8<D>::PASS;
    slot[i] = pos < n_end ? (bt[pos >> bs_log2] << bs_log2) | (pos & ((1 << bs_log2) - 1)) : -1;
  }
}

template <int D>
__device__ __forceinline__ void load_kv_tile8(uint8_t* dst, const uint8_t* cache, const int (&slot)[TileCopy8<D>::ROWS],
                                              int64_t tok_stride, int r0, int c) {
#pragma unroll
  for (int i = 0; i < TileCopy8<D>::ROWS; ++i) {
    const bool valid = slot[i] >= 0;
    const uint8_t* src = valid ? cache + (int64_t)slot[i] * tok_stride + c * 16 : cache;
    cp_async16(dst + (r0 + i * TileCopy8<D>::PASS) * D + c * 16, src, valid ? 16 : 0);
  }
}

// The pieces this thread copied with load_kv_tile8, widened into the swizzled 2-byte tile.
template <typename T, int D, int CF>
__device__ __forceinline__ void widen_tile8(T* dst, const uint8_t* raw, int r0, int c) {
#pragma unroll
  for (int i = 0; i < TileCopy8<D>::ROWS; ++i) {
    const int row = r0 + i * TileCopy8<D>::PASS;
    uint4 lo, hi;
    fp8x16_to_pairs<T, CF>(*reinterpret_cast<const uint4*>(raw + row * D + c * 16), lo, hi);
    *reinterpret_cast<uint4*>(dst + swz<D / 8>(row, 2 * c)) = lo;
    *reinterpret_cast<uint4*>(dst + swz<D / 8>(row, 2 * c + 1)) = hi;
  }
}

template <typename T, int D, int CF>
__global__ void __launch_bounds__(kThreads)
    paged_prefill_kernel(PagedAttnArgs a, const int* __restrict__ qsl, int seq_begin,
                         const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  constexpr int CH = D / 8, KS = D / 16, NT = kBN / 8, DT = D / 8;
  constexpr bool F8 = CF != kCacheNative;
  using C = std::conditional_t<F8, uint8_t, T>;
  extern __shared__ uint4 smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBM * D;
  T* sV = sK + 2 * kBN * D;
  uint8_t* sK8 = reinterpret_cast<uint8_t*>(sV + 2 * kBN * D);  // fp8 only
  uint8_t* sV8 = sK8 + 2 * kBN * D;

  const int s = seq_begin + blockIdx.z, h = blockIdx.y;
  const int q0 = qsl[s], qlen = qsl[s + 1] - q0, ctx = a.seq_lens[s];
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBM;  // late (heavy, causal) tiles are scheduled first
  if (m0 >= qlen) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = h / (a.num_q_heads / a.num_kv_heads);
  const int pos0 = ctx - qlen;                     // position of query row 0
  const int n_end = min(ctx, pos0 + m0 + kBM);     // keys visible to the last row of this tile
  const int n_tiles = (n_end + kBN - 1) / kBN;
  const int64_t tok_stride = (int64_t)a.num_kv_heads * D;
  const int* bt = a.block_tables + s * a.bt_stride;
  const C* kc = static_cast<const C*>(a.k_cache) + kvh * D;
  const C* vc = static_cast<const C*>(a.v_cache) + kvh * D;

  load_q_tile<T, D, kBM, kThreads>(sQ, a, h, q0, m0, qlen);  // rows past qlen: zero-filled
  constexpr int CCH = F8 ? TileCopy8<D>::CH : CH;
  const int cr0 = threadIdx.x / CCH, cc = threadIdx.x % CCH;  // this thread's rows and column in tile copies
  const int bs_log2 = __ffs(a.block_size) - 1;
  // The tile copies of either cache format: slots, K/V loads into stage `st`, and (fp8) widening after landing.
  int slot[F8 ? TileCopy8<D>::ROWS : TileCopyN<D>::ROWS];
  auto slots_at = [&](int n0) {
    if constexpr (F8) tile_slots8<D>(slot, bt, bs_log2, n0, n_end, cr0);
    else tile_slots<D, kThreads, kBN>(slot, bt, bs_log2, n0, n_end, cr0);
  };
  auto load_k = [&](int st) {
    if constexpr (F8) load_kv_tile8<D>(sK8 + st * kBN * D, kc, slot, tok_stride, cr0, cc);
    else load_kv_tile<T, D, kThreads, kBN>(sK + st * kBN * D, kc, slot, tok_stride, cr0, cc);
  };
  auto load_v = [&](int st) {
    if constexpr (F8) load_kv_tile8<D>(sV8 + st * kBN * D, vc, slot, tok_stride, cr0, cc);
    else load_kv_tile<T, D, kThreads, kBN>(sV + st * kBN * D, vc, slot, tok_stride, cr0, cc);
  };
  slots_at(0);
  load_k(0);
  cp_async_commit();
  load_v(0);
  cp_async_commit();
  if (n_tiles > 1) slots_at(kBN);
  cp_async_wait<1>();
  if constexpr (F8) widen_tile8<T, D, CF>(sK, sK8, cr0, cc);
  __syncthreads();

  uint32_t qa[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qa[ks], sQ + swz<CH>(warp * 16 + (lane & 15), 2 * ks + (lane >> 4)));

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
  float sl2 = a.scale * kLog2e;
  if constexpr (F8) sl2 *= k_scale[kvh];
  const int row_pos0 = pos0 + m0 + warp * 16 + lane / 4;  // position of this thread's first row

  for (int j = 0; j < n_tiles; ++j) {
    const T* sKj = sK + (j & 1) * kBN * D;
    const T* sVj = sV + (j & 1) * kBN * D;
    if (j > 0) {
      cp_async_wait<1>();  // K_j landed (V_j may still be in flight)
      if constexpr (F8) widen_tile8<T, D, CF>(sK + (j & 1) * kBN * D, sK8 + (j & 1) * kBN * D, cr0, cc);
      __syncthreads();
    }
    // Every warp finished tile j-1 before the barrier above, so the other K stage is free to refill.
    if (j + 1 < n_tiles) load_k((j + 1) & 1);
    cp_async_commit();  // an empty group at the end keeps the wait counts uniform

    float sc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, sKj + swz<CH>(np * 16 + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
        mma16816<T>(sc[2 * np], qa[ks], b[0], b[1]);
        mma16816<T>(sc[2 * np + 1], qa[ks], b[2], b[3]);
      }
    }

    // Causal mask, only on tiles that reach past this warp's first row.
    if (j * kBN + kBN - 1 > pos0 + m0 + warp * 16) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * kBN + nt * 8 + (lane % 4) * 2 + (e & 1);
          if (key > row_pos0 + (e >> 1) * 8) sc[nt][e] = -CUDART_INF_F;
        }
    }

    // Online softmax for the thread's two rows.
    online_softmax_row<NT, DT>(sc, o, mrow[0], lrow[0], sl2, 0);
    online_softmax_row<NT, DT>(sc, o, mrow[1], lrow[1], sl2, 1);

    cp_async_wait<1>();  // V_j landed (K_{j+1} may still be in flight)
    if constexpr (F8) widen_tile8<T, D, CF>(sV + (j & 1) * kBN * D, sV8 + (j & 1) * kBN * D, cr0, cc);
    __syncthreads();
    if (j + 1 < n_tiles) load_v((j + 1) & 1);
    cp_async_commit();
    if (j + 2 < n_tiles) slots_at((j + 2) * kBN);  // lands during P*V

#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      // The S accumulator layout of two adjacent n-tiles is exactly the A fragment of one k-step.
      const uint32_t pa[4] = {DType<T>::from_float2(sc[2 * kk][0], sc[2 * kk][1]),
                              DType<T>::from_float2(sc[2 * kk][2], sc[2 * kk][3]),
                              DType<T>::from_float2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              DType<T>::from_float2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sVj + swz<CH>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, 2 * dp + (lane >> 4)));
        mma16816<T>(o[2 * dp], pa, b[0], b[1]);
        mma16816<T>(o[2 * dp + 1], pa, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = warp_sum_xor(lrow[r], 1, 4);
    const int row = m0 + warp * 16 + lane / 4 + r * 8;
    if (row >= qlen) continue;
    float inv = 1.f / l;
    if constexpr (F8) inv = v_scale[kvh] / l;
    T* op = static_cast<T*>(a.out) + (int64_t)(q0 + row) * a.out_stride_t + h * a.out_stride_h + (lane % 4) * 2;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<uint32_t*>(op + i * 8) = DType<T>::from_float2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
  }
}

template <typename T, int D, int CF>
cudaError_t launch_cf(const PagedAttnArgs& a, const int* qsl, int seq_begin, int max_query_len,
                      cudaStream_t stream, const float* ks, const float* vs) {
  constexpr int smem = CF == kCacheNative ? smem_bytes<D>() : smem_bytes_fp8<D>();
  // Above 48 KB of dynamic shared memory a kernel must opt in; once per instantiation is enough.
  static const cudaError_t attr = cudaFuncSetAttribute(
      paged_prefill_kernel<T, D, CF>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid((max_query_len + kBM - 1) / kBM, a.num_q_heads, a.num_seqs);
  return launch_kernel(paged_prefill_kernel<T, D, CF>, grid, dim3(kThreads), smem, stream, a, qsl, seq_begin, ks,
                       vs);
}

template <typename T, int D>
cudaError_t launch_typed(const PagedAttnArgs& a, const int* qsl, int seq_begin, int max_query_len,
                         cudaStream_t stream, const KvQuant* q) {
  if (q == nullptr) return launch_cf<T, D, kCacheNative>(a, qsl, seq_begin, max_query_len, stream, nullptr, nullptr);
  switch (cache_format_of(q->cache_dtype, a.dtype)) {
    case kCacheE4M3: return launch_cf<T, D, kCacheE4M3>(a, qsl, seq_begin, max_query_len, stream, q->k_scale, q->v_scale);
    case kCacheE5M2: return launch_cf<T, D, kCacheE5M2>(a, qsl, seq_begin, max_query_len, stream, q->k_scale, q->v_scale);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_paged_prefill(const PagedAttnArgs& a, const int* query_start_loc, int seq_begin,
                                 int max_query_len, cudaStream_t stream, const KvQuant* quant) {
  if (!prefill_args_valid(a, max_query_len)) return cudaErrorInvalidValue;
  if (quant != nullptr && (quant->k_scale == nullptr || quant->v_scale == nullptr)) return cudaErrorInvalidValue;
  if (a.num_seqs == 0 || max_query_len == 0) return cudaSuccess;
  const bool bf16 = a.dtype == ScalarType::kBFloat16;
  if (a.head_dim == 128)
    return bf16 ? launch_typed<__nv_bfloat16, 128>(a, query_start_loc, seq_begin, max_query_len, stream, quant)
                : launch_typed<__half, 128>(a, query_start_loc, seq_begin, max_query_len, stream, quant);
  if (a.head_dim == 64)
    return bf16 ? launch_typed<__nv_bfloat16, 64>(a, query_start_loc, seq_begin, max_query_len, stream, quant)
                : launch_typed<__half, 64>(a, query_start_loc, seq_begin, max_query_len, stream, quant);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
