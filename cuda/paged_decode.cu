// Paged decode attention: one query token per sequence against its paged K/V.
//
// Variants (one kernel body, chosen by the launcher's partition_size):
//   v1        grid (1, kv_heads, seqs): one CTA per (sequence, KV head) walks the whole context.
//   v2 split  grid (partitions, kv_heads, seqs): each CTA covers one partition of its sequence's context and
//             stores its normalised output with its max and exp-sum; decode_reduce_kernel merges them.
//             partition_size > 0: fixed partitions of that many tokens (the grid covers the longest context);
//             partition_size = -P: every sequence is cut into P equal partitions (a whole number of 32-token
//             steps each, at least 256 tokens), so a ragged batch has no CTA much longer than the others and a
//             CUDA graph's grid does not depend on max_model_len.
// All query heads of a GQA group live in the same CTA, so each K/V chunk loaded from HBM serves all of them.
//
// Work split inside a CTA: 4 warps take 8-token chunks round-robin; in a warp, each lane owns one 16-byte
// piece (8 dims) of a head row, CH = D/8 lanes cover one token and 32/CH tokens are in flight per step. Each
// warp streams its chunks through a ring of kStages chunk buffers in shared memory with cp.async, so up to
// kStages - 1 chunks (12 KB at D = 128) of its loads are in flight while it computes on the oldest: with three
// CTAs per SM that keeps ~150 KB per SM outstanding, what HBM needs to run near its peak (register double
// buffering, the previous scheme, held half of that and used 64 more registers). A lane reads back only the
// pieces it copied itself, so the ring needs no barrier. Softmax is online (running max and sum per warp, fp32,
// exp2 with the scale folded into q), and the warps are merged through shared memory at the end.
// (Merging the partitions in the last CTA of each (sequence, KV head), with a ticket counter, instead of the
// reduce kernel was tried: every CTA then holds its SM slot through a fence and an atomic round trip, and the
// kernel got ~25% slower in the offline bench, far more than the ~5 us reduce launch it saves; docs/perf-log.md.)
#include <math_constants.h>

#include "attention.h"
#include "common.cuh"

namespace minillm {
namespace {

constexpr int kWarps = 4;
constexpr int kChunk = 8;  // tokens handled together by one warp (two chunks in flight per warp)

constexpr int kStages = 4;  // chunk buffers per warp in the shared-memory ring
constexpr int kSplitQuantum = kWarps * kChunk;  // equal partitions are multiples of this: whole steps of all warps
// Equal partitions are never shorter than this: a CTA's fixed costs (q load, merge, workspace row, its share of
// the reduce) want a few hundred tokens to hide behind, and a short context then simply uses fewer partitions.
constexpr int kMinSplitLen = 256;

// Tokens per partition of a sequence of `ctx` tokens (0 for v1); see the header for the two split modes.
__device__ __forceinline__ int partition_len(int partition_size, int num_partitions, int ctx) {
  if (partition_size >= 0) return partition_size;
  const int per = (ctx + num_partitions - 1) / num_partitions;
  return max(kMinSplitLen, (per + kSplitQuantum - 1) / kSplitQuantum * kSplitQuantum);
}

// Start the copy of one chunk (kChunk tokens) of K and V into a ring slot [2][IT][32] of 16-byte pieces: each
// lane its own piece of IT tokens. Tokens past the end are zero-filled, never read: their slots may hold another
// sequence's data or NaN, and a zero V times a zero weight keeps the accumulator finite.
template <typename T, int BS, int IT, int TPI>
__device__ __forceinline__ void issue_chunk(const T* kc, const T* vc, const int* bt, int ch, int end, int sub,
                                            int lane, int64_t tok_stride, uint4* slot) {
  const int tok0 = ch * kChunk;
  const int64_t slot0 = (int64_t)bt[tok0 / BS] * BS + tok0 % BS;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int t = it * TPI + sub;
    const bool valid = tok0 + t < end;
    const int64_t off = valid ? (slot0 + t) * tok_stride : 0;
    cp_async16(slot + it * 32 + lane, kc + off, valid ? 16 : 0);
    cp_async16(slot + (IT + it) * 32 + lane, vc + off, valid ? 16 : 0);
  }
}

// Scores of the chunk for every head of the group, then the online-softmax update of m, l and acc.
template <typename T, int GP, int IT, int TPI, int CH>
__device__ __forceinline__ void attend_chunk(const uint4 (&kr)[IT], const uint4 (&vr)[IT], int tok0, int end,
                                             int sub, const float (&qf)[GP][8], float (&m)[GP], float (&l)[GP],
                                             float (&acc)[GP][8]) {
  float sc[GP][IT];
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    float kf[8];
    unpack8<T>(kr[it], kf);
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      float d = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) d = fmaf(qf[g][j], kf[j], d);
      d = warp_sum_xor(d, 1, CH);
      sc[g][it] = (tok0 + it * TPI + sub < end) ? d : -CUDART_INF_F;
    }
  }
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    float mx = sc[g][0];
#pragma unroll
    for (int it = 1; it < IT; ++it) mx = fmaxf(mx, sc[g][it]);
    mx = warp_max_xor(mx, CH, 32);
    const float m_new = fmaxf(m[g], mx);  // finite: every chunk holds at least one valid token
    const float alpha = exp2f(m[g] - m_new);
    m[g] = m_new;
    l[g] *= alpha;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] *= alpha;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const float p = exp2f(sc[g][it] - m_new);
      l[g] += p;
      float vf[8];
      unpack8<T>(vr[it], vf);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(p, vf[j], acc[g][j]);
    }
  }
}

template <int D>
constexpr int ring_bytes() {  // dynamic shared memory of one CTA: kWarps rings of kStages [2][IT][32] pieces
  return kWarps * kStages * 2 * (kChunk / (32 / (D / 8))) * 32 * 16;
}

template <typename T, int D, int BS, int GP>
__global__ void __launch_bounds__(kWarps * 32)
    paged_decode_kernel(PagedAttnArgs a, int partition_size, float* __restrict__ ws_out,
                        float* __restrict__ ws_max, float* __restrict__ ws_sum) {
  constexpr int CH = D / 8;         // lanes per token
  constexpr int TPI = 32 / CH;      // tokens per warp step
  constexpr int IT = kChunk / TPI;  // steps per chunk
  constexpr int SLOT = 2 * IT * 32; // 16-byte pieces per ring slot (K and V of one chunk)
  static_assert(BS % kChunk == 0, "block size must be a multiple of the chunk");
  extern __shared__ uint4 ring_smem[];

  __shared__ float sm_acc[kWarps][GP][D];
  __shared__ float sm_m[kWarps][GP];
  __shared__ float sm_l[kWarps][GP];

  const int s = blockIdx.z, kvh = blockIdx.y, part = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = lane % CH, sub = lane / CH;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int ctx = a.seq_lens[s];
  const int psz = partition_len(partition_size, gridDim.x, ctx);
  const int start = psz > 0 ? part * psz : 0;
  const int end = psz > 0 ? min(ctx, start + psz) : ctx;
  if (start >= end) {
    // A partition past the context is never read by the reduce kernel. An empty context (a padding row of a
    // CUDA-graph batch, say) gets a defined all-zero output instead of 0/0.
    if (psz == 0)
      for (int i = threadIdx.x; i < group * D; i += kWarps * 32)
        static_cast<T*>(a.out)[s * a.out_stride_t + (kvh * group + i / D) * a.out_stride_h + i % D] = DType<T>::from_float(0.f);
    return;
  }

  // q of every head in the group, pre-scaled so that exp2(score - max) is the softmax numerator.
  float qf[GP][8];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    if (g < group) {
      const T* qp = static_cast<const T*>(a.q) + s * a.q_stride_t + (kvh * group + g) * a.q_stride_h + c * 8;
      unpack8<T>(*reinterpret_cast<const uint4*>(qp), qf[g]);
#pragma unroll
      for (int j = 0; j < 8; ++j) qf[g][j] *= a.scale * kLog2e;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) qf[g][j] = 0.f;
    }
  }

  float m[GP], l[GP], acc[GP][8];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    m[g] = -CUDART_INF_F;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  }

  const int64_t tok_stride = (int64_t)a.num_kv_heads * D;  // elements between consecutive slots
  const int* bt = a.block_tables + s * a.bt_stride;
  const T* kc = static_cast<const T*>(a.k_cache) + kvh * D + c * 8;
  const T* vc = static_cast<const T*>(a.v_cache) + kvh * D + c * 8;
  const int first = start / kChunk, last = (end + kChunk - 1) / kChunk;

  uint4* ring = ring_smem + warp * kStages * SLOT;
  const int ch0 = first + warp;
  const int mine = ch0 < last ? (last - ch0 + kWarps - 1) / kWarps : 0;  // chunks of this warp
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < mine) issue_chunk<T, BS, IT, TPI>(kc, vc, bt, ch0 + i * kWarps, end, sub, lane, tok_stride, ring + i * SLOT);
    cp_async_commit();  // empty groups too: the wait count below stays uniform
  }
  for (int i = 0; i < mine; ++i) {
    // Refill the slot consumed in the previous iteration: its values were read into registers and used there.
    const int j = i + kStages - 1;
    if (j < mine)
      issue_chunk<T, BS, IT, TPI>(kc, vc, bt, ch0 + j * kWarps, end, sub, lane, tok_stride, ring + (j % kStages) * SLOT);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // chunk i has landed
    const uint4* slot = ring + (i % kStages) * SLOT;
    uint4 kr[IT], vr[IT];
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      kr[it] = slot[it * 32 + lane];
      vr[it] = slot[(IT + it) * 32 + lane];
    }
    attend_chunk<T, GP, IT, TPI, CH>(kr, vr, (ch0 + i * kWarps) * kChunk, end, sub, qf, m, l, acc);
  }

  // Lanes with the same chunk but different tokens hold partial sums: fold them, then stage per warp.
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    l[g] = warp_sum_xor(l[g], CH, 32);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = warp_sum_xor(acc[g][j], CH, 32);
    if (sub == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm_acc[warp][g][c * 8 + j] = acc[g][j];
    }
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
  }
  __syncthreads();

  const int heads = min(group, GP);
  for (int i = threadIdx.x; i < heads * D; i += kWarps * 32) {
    const int g = i / D, d = i % D;
    float mmax = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mmax = fmaxf(mmax, sm_m[w][g]);
    float lsum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(sm_m[w][g] - mmax);  // 0 for a warp that saw no chunk (m = -inf)
      lsum += sm_l[w][g] * f;
      o += sm_acc[w][g][d] * f;
    }
    const int h = kvh * group + g;
    if (psz == 0) {
      T* op = static_cast<T*>(a.out) + s * a.out_stride_t + h * a.out_stride_h;
      op[d] = DType<T>::from_float(o / lsum);
    } else {
      const int64_t row = ((int64_t)s * a.num_q_heads + h) * gridDim.x + part;
      ws_out[row * D + d] = o / lsum;
      if (d == 0) {
        ws_max[row] = mmax;
        ws_sum[row] = lsum;
      }
    }
  }
}

// Merge split-K partitions: out = sum_p w_p * o_p / sum_p w_p with w_p = sum_p * 2^(max_p - max).
// One warp per (sequence, query head): lane p reads partition p's max and sum (all partitions' loads in flight
// at once instead of one after another), the weights are broadcast by shuffles, and each lane accumulates
// D / 32 output dims over the partitions in order with vector loads.
constexpr int kReduceWarps = 4;

template <typename T, int D>
__global__ void __launch_bounds__(kReduceWarps * 32)
    decode_reduce_kernel(PagedAttnArgs a, int partition_size, int num_partitions, const float* __restrict__ ws_out,
                         const float* __restrict__ ws_max, const float* __restrict__ ws_sum) {
  constexpr int DPL = D / 32;  // output dims per lane
  const int s = blockIdx.y, h = blockIdx.x * kReduceWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (h >= a.num_q_heads) return;
  const int ctx = a.seq_lens[s];
  const int psz = partition_len(partition_size, num_partitions, ctx);
  const int valid = (ctx + psz - 1) / psz;  // 0 for an empty context: zeros, as in v1
  const int64_t row0 = ((int64_t)s * a.num_q_heads + h) * num_partitions;
  float mmax = -CUDART_INF_F;
  for (int p = lane; p < valid; p += 32) mmax = fmaxf(mmax, ws_max[row0 + p]);
  mmax = warp_max_xor(mmax, 1, 32);
  float o[DPL] = {}, lsum = 0.f;
  for (int p0 = 0; p0 < valid; p0 += 32) {
    const int p = p0 + lane;
    const float w = p < valid ? ws_sum[row0 + p] * exp2f(ws_max[row0 + p] - mmax) : 0.f;
    lsum += w;
    const int n = min(32, valid - p0);
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const float wj = __shfl_sync(0xffffffffu, w, j);
      const float* src = ws_out + (row0 + p0 + j) * D + lane * DPL;
#pragma unroll
      for (int i = 0; i < DPL; ++i) o[i] = fmaf(wj, src[i], o[i]);
    }
  }
  lsum = warp_sum_xor(lsum, 1, 32);
  T* op = static_cast<T*>(a.out) + s * a.out_stride_t + h * a.out_stride_h + lane * DPL;
#pragma unroll
  for (int i = 0; i < DPL; ++i) op[i] = DType<T>::from_float(valid > 0 ? o[i] / lsum : 0.f);
}

template <typename T, int D, int BS, int GP>
cudaError_t launch_typed(const PagedAttnArgs& a, int partition_size, int num_partitions, float* ws_out,
                         float* ws_max, float* ws_sum, cudaStream_t stream) {
  const dim3 grid(partition_size != 0 ? num_partitions : 1, a.num_kv_heads, a.num_seqs);
  constexpr int smem = ring_bytes<D>();
  // Above 48 KB of dynamic shared memory a kernel must opt in. Set on every launch, so that it holds on whichever
  // device is current; it is a function attribute, not a stream operation, so launches can still be captured.
  const cudaError_t opt_in = cudaFuncSetAttribute(paged_decode_kernel<T, D, BS, GP>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (opt_in != cudaSuccess) return opt_in;
  paged_decode_kernel<T, D, BS, GP><<<grid, kWarps * 32, smem, stream>>>(a, partition_size, ws_out, ws_max, ws_sum);
  if (partition_size != 0) {
    const dim3 reduce_grid((a.num_q_heads + kReduceWarps - 1) / kReduceWarps, a.num_seqs);
    decode_reduce_kernel<T, D><<<reduce_grid, kReduceWarps * 32, 0, stream>>>(a, partition_size, num_partitions,
                                                                               ws_out, ws_max, ws_sum);
  }
  return cudaGetLastError();
}

// Group sizes are rounded up to 1, 2, 4 or 8 (padding heads compute on zero q and are never stored).
template <typename T, int D, int BS>
cudaError_t dispatch_group(const PagedAttnArgs& a, int ps, int np, float* wo, float* wm, float* wsum,
                           cudaStream_t st) {
  const int group = a.num_q_heads / a.num_kv_heads;
  if (group == 1) return launch_typed<T, D, BS, 1>(a, ps, np, wo, wm, wsum, st);
  if (group == 2) return launch_typed<T, D, BS, 2>(a, ps, np, wo, wm, wsum, st);
  if (group <= 4) return launch_typed<T, D, BS, 4>(a, ps, np, wo, wm, wsum, st);
  if (group <= 8) return launch_typed<T, D, BS, 8>(a, ps, np, wo, wm, wsum, st);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t dispatch_shape(const PagedAttnArgs& a, int ps, int np, float* wo, float* wm, float* wsum,
                           cudaStream_t st) {
  if (a.head_dim == 128 && a.block_size == 16) return dispatch_group<T, 128, 16>(a, ps, np, wo, wm, wsum, st);
  if (a.head_dim == 128 && a.block_size == 32) return dispatch_group<T, 128, 32>(a, ps, np, wo, wm, wsum, st);
  if (a.head_dim == 64 && a.block_size == 16) return dispatch_group<T, 64, 16>(a, ps, np, wo, wm, wsum, st);
  if (a.head_dim == 64 && a.block_size == 32) return dispatch_group<T, 64, 32>(a, ps, np, wo, wm, wsum, st);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_paged_decode(const PagedAttnArgs& a, int partition_size, int num_partitions, float* ws_out,
                                float* ws_max, float* ws_sum, cudaStream_t stream) {
  const bool fixed_ok = partition_size >= 0 && partition_size % 256 == 0;
  const bool equal_ok = partition_size < 0 && num_partitions == -partition_size;
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || !(fixed_ok || equal_ok) ||
      (partition_size != 0 && (num_partitions <= 0 || ws_out == nullptr)))
    return cudaErrorInvalidValue;
  if (a.num_seqs == 0) return cudaSuccess;
  if (a.dtype == kBF16)
    return dispatch_shape<__nv_bfloat16>(a, partition_size, num_partitions, ws_out, ws_max, ws_sum, stream);
  if (a.dtype == kFP16)
    return dispatch_shape<__half>(a, partition_size, num_partitions, ws_out, ws_max, ws_sum, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
