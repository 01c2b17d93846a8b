// Paged decode attention: one query token per sequence against its paged K/V.
//
// Variants (one kernel body, chosen by the launcher's partition_size):
//   v1        grid (1, kv_heads, seqs): one CTA per (sequence, KV head) walks the whole context.
//   v2 split  grid (partitions, kv_heads, seqs): each CTA covers one partition of its sequence's context and
//             stores its normalised output with its max and exp-sum; decode_reduce_kernel merges them.
//             partition_size > 0: fixed partitions of that many tokens (the grid covers the longest context);
//             partition_size = -P: every sequence is cut into P equal partitions (a whole number of 64-token
//             steps each, at least 256 tokens), so a ragged batch has no CTA much longer than the others and a
//             CUDA graph's grid does not depend on max_model_len.
// All query heads of a GQA group live in the same CTA, so each K/V chunk loaded from HBM serves all of them.
//
// Tensor cores, the way a prefill tile works: the group's query heads are the rows of a 16-row mma A operand
// (rows past the group are zero), so S = Q K^T over a 16-token chunk is 2 n-tiles x D/16 k-steps of
// mma.sync m16n8k16 and O += P V one k-step x D/8 n-tiles, with operands from swizzled shared memory by
// ldmatrix. The CUDA-core version this replaced reduced every score across 16 lanes with shuffles; at ~2.9
// instructions per cycle it was close to issue-bound (ncu), 3.5-3.9 TB/s. Padding rows cost tensor-core
// throughput, of which decode needs a small fraction.
//
// Work split inside a CTA: 4 warps take 16-token chunks round-robin (a chunk never crosses a cache block), each
// through its own ring of kStages slots filled by cp.async, so two chunks (16 KB at D = 128) per warp are in
// flight while it computes on a third; two CTAs per SM keep ~128 KB outstanding. Softmax is online (running max
// and sum per row, fp32, exp2), and the warps are merged through shared memory (reusing the ring) at the end.
// (Merging the partitions in the last CTA of each (sequence, KV head), with a ticket counter, instead of the
// reduce kernel was tried: every CTA then holds its SM slot through a fence and an atomic round trip, and the
// kernel got ~25% slower in the offline bench, far more than the ~5 us reduce launch it saves; docs/perf-log.md.)
//
// An fp8 cache (CF = kCacheE4M3 / kCacheE5M2, kv_fp8.cuh) streams fp8 bytes through a deeper ring (kStagesFp8
// slots of half the bytes: the same shared memory, five chunks in flight per warp) and forms the mma operands in
// registers straight from those bytes, with no widened copy in shared memory and no extra sync:
//   S = Q K^T: lane (n = lane / 4, c = lane % 4) reads D / 4 consecutive bytes of K rows n and 8 + n, one 32-bit
//     word per k-step. The k order inside a k-step is free as long as Q uses the same one, so q is loaded in that
//     order (fp16: bytes (0,1), (2,3) of the word are the two B registers; bf16: (0,2), (1,3), see kv_fp8.cuh).
//   O += P V: the head dims (the n of the B operand) are permuted instead: n-tile t, column n is dim n * D/8 + t,
//     so lane n reads D / 8 consecutive bytes of each of its four V rows (tokens 2c, 2c+1, 2c+8, 2c+9) and a byte
//     permute pairs the tokens; the merge writes each accumulator to its real dim. P V is an fp16 mma for either
//     activation dtype (every e4m3 and e5m2 value is exact in fp16, P in [0, 1] rounds at least as finely as in
//     bf16), so V needs one hardware conversion per pair (e4m3) or a byte move (e5m2).
//   Slots are XOR-swizzled (fp8_off) so that these loads hit distinct banks (D = 128; D = 64 V: 2-way at worst).
// The K scale goes into the fp32 softmax scale, the V scale onto the fp32 output; softmax and both accumulations
// stay fp32. With bf16 activations an fp8 NaN in K would read as a finite value, so the lanes OR a NaN test of
// every K word and a CTA that saw one writes NaN, as the reference (and a bf16 cache) would.
#include <math_constants.h>

#include <type_traits>

#include "attention.h"
#include "common.cuh"
#include "kv_fp8.cuh"
#include "launch.h"

namespace minillm {
namespace {

constexpr int kWarps = 4;
// Tokens per warp step: two n-tiles of S = Q K^T and one k-step of O += P V on mma.sync m16n8k16. A chunk never
// crosses a cache block (block sizes are multiples of it), so its 16 slots are consecutive.
constexpr int kChunk = 16;
constexpr int kStages = 3;  // chunk buffers per warp in the shared-memory ring (two in flight while one is used)
constexpr int kStagesFp8 = 6;  // fp8: slots of half the bytes, so the same 96 KB (D = 128) keeps five in flight
constexpr int kSplitQuantum = kWarps * kChunk;  // equal partitions are multiples of this: whole steps of all warps
// Equal partitions are never shorter than this: a CTA's fixed costs (q load, merge, workspace row, its share of
// the reduce) want a few hundred tokens to hide behind, and a short context then simply uses fewer partitions.
constexpr int kMinSplitLen = 256;
constexpr int kMaxGroup = 16;  // query heads per KV head: the 16 rows of the mma A operand

// Tokens per partition of a sequence of `ctx` tokens (0 for v1); see the header for the two split modes.
__device__ __forceinline__ int partition_len(int partition_size, int num_partitions, int ctx) {
  if (partition_size >= 0) return partition_size;
  const int per = (ctx + num_partitions - 1) / num_partitions;
  return max(kMinSplitLen, (per + kSplitQuantum - 1) / kSplitQuantum * kSplitQuantum);
}

template <int D>
constexpr int stage_elems() { return 2 * kChunk * D; }  // one ring slot: the chunk's K rows, then its V rows

template <int CF>
constexpr int ring_stages() { return CF == kCacheNative ? kStages : kStagesFp8; }

// Every warp's ring: 2-byte elements, or fp8 bytes.
template <int D, int CF>
constexpr int smem_bytes() { return kWarps * ring_stages<CF>() * stage_elems<D>() * (CF == kCacheNative ? 2 : 1); }

// The cache's element type: T itself, or fp8 bytes.
template <typename T, int CF>
using CacheElem = std::conditional_t<CF == kCacheNative, T, uint8_t>;

// Start the copy of one chunk of K and V (kChunk tokens from tok0, cache block `blk`) into a swizzled ring slot.
// Lane piece p = lane + 32 i is 16 bytes: row p / CH (K rows, then V rows), column p % CH. Tokens past `end` are
// zero-filled, never read: their slots may hold another sequence's data or NaN, and a zero V times a zero weight
// keeps the accumulator finite.
template <typename T, int D, int BS>
__device__ __forceinline__ void issue_chunk(T* slot, const T* kc, const T* vc, int blk, int tok0, int end, int lane,
                                            int64_t tok_stride) {
  constexpr int CH = D / 8, PIECES = 2 * kChunk * CH / 32;
  const int64_t slot0 = (int64_t)blk * BS + tok0 % BS;
#pragma unroll
  for (int i = 0; i < PIECES; ++i) {
    const int p = lane + 32 * i, row = p / CH, c = p % CH, t = row % kChunk;
    const bool valid = tok0 + t < end;
    const T* base = row < kChunk ? kc : vc;
    cp_async16(slot + swz<CH>(row, c), valid ? base + (slot0 + t) * tok_stride + c * 8 : base, valid ? 16 : 0);
  }
}

// fp8 slot: K rows 0-15, then V rows 16-31, D bytes each; 16-byte chunk c of a row sits at chunk c ^ x. K is read
// as rows n and n + 1 at the same chunks in one quarter warp (x = row & 1 splits them over the banks at D = 128; at
// D = 64 two rows already fill them); V as rows 2c (+1, +8, +9) at chunk n (x = row & 6, or row & 2 at D = 64).
template <int D>
__device__ __forceinline__ int fp8_off(int row, int c) {
  constexpr int CH8 = D / 16;
  const int x = row < kChunk ? (CH8 == 8 ? row & 1 : 0) : row & (CH8 - 2);
  return row * D + (c ^ x) * 16;
}

// fp8: the same chunk as 16-byte pieces of 16 bytes (row p / CH8, column p % CH8), zero past `end`.
template <int D, int BS>
__device__ __forceinline__ void issue_chunk_fp8(uint8_t* slot, const uint8_t* kc, const uint8_t* vc, int blk, int tok0,
                                                int end, int lane, int64_t tok_stride) {
  constexpr int CH8 = D / 16, PIECES = 2 * kChunk * CH8 / 32;
  const int64_t slot0 = (int64_t)blk * BS + tok0 % BS;
#pragma unroll
  for (int i = 0; i < PIECES; ++i) {
    const int p = lane + 32 * i, row = p / CH8, c = p % CH8, t = row % kChunk;
    const bool valid = tok0 + t < end;
    const uint8_t* base = row < kChunk ? kc : vc;
    cp_async16(slot + fp8_off<D>(row, c), valid ? base + (slot0 + t) * tok_stride + c * 16 : base, valid ? 16 : 0);
  }
}

// bf16 activations read K as byte pairs (0,2), (1,3) of each word (kv_fp8.cuh), fp16 as (0,1), (2,3).
template <typename T>
constexpr bool kSplitPairs = std::is_same_v<T, __nv_bfloat16>;

// S = Q K^T of one fp8 chunk (see the header): this lane's KS words of K rows n and 8 + n, widened per k-step.
template <typename T, int D, int CF>
__device__ __forceinline__ void fp8_scores(const uint8_t* slot, const uint32_t (&qa)[D / 16][4], int lane,
                                           float (&sc)[2][4], uint32_t& nan_bits) {
  constexpr int KS = D / 16, KPW = D / 64;  // k-steps; 16-byte chunks per lane and row
  const int n = lane / 4, c = lane % 4;
  uint32_t kw[2][KS];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int h = 0; h < KPW; ++h) {
      const uint4 v = *reinterpret_cast<const uint4*>(slot + fp8_off<D>(nt * 8 + n, c * KPW + h));
      kw[nt][4 * h] = v.x, kw[nt][4 * h + 1] = v.y, kw[nt][4 * h + 2] = v.z, kw[nt][4 * h + 3] = v.w;
    }
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t b0, b1;
      if constexpr (kSplitPairs<T>) {
        fp8x4_to_bf16x2_split<CF>(kw[nt][ks], b0, b1);
        nan_bits |= fp8_nan_bits<CF>(kw[nt][ks]);
      } else {
        b0 = fp8x2_lo_to_half2<CF>(kw[nt][ks]);
        b1 = fp8x2_hi_to_half2<CF>(kw[nt][ks]);
      }
      mma16816<T>(sc[nt], qa[ks], b0, b1);
    }
}

// O += P V of one fp8 chunk: pa is P in fp16; this lane's D / 8 bytes of V rows 2c, 2c+1, 2c+8, 2c+9; n-tile
// 4q + j takes byte j of word q of each row, paired by token.
template <int D, int CF>
__device__ __forceinline__ void fp8_pv(const uint8_t* slot, const uint32_t (&pa)[4], int lane, float (&o)[D / 8][4]) {
  constexpr int DT = D / 8, W = DT / 4;  // n-tiles; words per lane and row
  const int n = lane / 4, c = lane % 4;
  uint32_t vw[4][W];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = kChunk + 2 * c + (r & 1) + (r >> 1) * 8;
    const uint8_t* p = slot + fp8_off<D>(row, n * DT / 16) + (n * DT) % 16;
    if constexpr (W == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      vw[r][0] = v.x, vw[r][1] = v.y, vw[r][2] = v.z, vw[r][3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      vw[r][0] = v.x, vw[r][1] = v.y;
    }
  }
#pragma unroll
  for (int q = 0; q < W; ++q) {
    // bytes (token 2c, token 2c+1) of dims j, j+1: the low and high halves of these words
    const uint32_t lo01 = __byte_perm(vw[0][q], vw[1][q], 0x5140), hi01 = __byte_perm(vw[0][q], vw[1][q], 0x7362);
    const uint32_t lo89 = __byte_perm(vw[2][q], vw[3][q], 0x5140), hi89 = __byte_perm(vw[2][q], vw[3][q], 0x7362);
    mma16816<__half>(o[4 * q], pa, fp8x2_lo_to_half2<CF>(lo01), fp8x2_lo_to_half2<CF>(lo89));
    mma16816<__half>(o[4 * q + 1], pa, fp8x2_hi_to_half2<CF>(lo01), fp8x2_hi_to_half2<CF>(lo89));
    mma16816<__half>(o[4 * q + 2], pa, fp8x2_lo_to_half2<CF>(hi01), fp8x2_lo_to_half2<CF>(hi89));
    mma16816<__half>(o[4 * q + 3], pa, fp8x2_hi_to_half2<CF>(hi01), fp8x2_hi_to_half2<CF>(hi89));
  }
}

template <typename T, int D, int BS, int CF>
__device__ __forceinline__ void issue_any(CacheElem<T, CF>* slot, const CacheElem<T, CF>* kc, const CacheElem<T, CF>* vc,
                                          int blk, int tok0, int end, int lane, int64_t tok_stride) {
  if constexpr (CF == kCacheNative)
    issue_chunk<T, D, BS>(slot, kc, vc, blk, tok0, end, lane, tok_stride);
  else
    issue_chunk_fp8<D, BS>(slot, kc, vc, blk, tok0, end, lane, tok_stride);
}

// 32 bits (two elements) of q, or zero for a padding row of the A operand.
template <typename T>
__device__ __forceinline__ uint32_t q_pair(const T* q, bool valid) {
  return valid ? *reinterpret_cast<const uint32_t*>(q) : 0u;
}

template <typename T, int D, int BS, int CF>
__global__ void __launch_bounds__(kWarps * 32)
    paged_decode_kernel(PagedAttnArgs a, int partition_size, float* __restrict__ ws_out,
                        float* __restrict__ ws_max, float* __restrict__ ws_sum, const float* __restrict__ k_scale,
                        const float* __restrict__ v_scale) {
  // Launched with PDL (launch.h), this kernel reads only what is older than the kernel before it (the step's
  // inputs, the block tables, the cached tokens) until its pdl_wait below; everything else comes after it.
  constexpr int CH = D / 8, KS = D / 16, DT = D / 8, SLOT = stage_elems<D>();
  static_assert(BS % kChunk == 0, "block size must be a multiple of the chunk");
  extern __shared__ uint4 ring_smem[];

  const int s = blockIdx.z, kvh = blockIdx.y, part = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int ctx = a.seq_lens[s];
  const int psz = partition_len(partition_size, gridDim.x, ctx);
  const int start = psz > 0 ? part * psz : 0;
  const int end = psz > 0 ? min(ctx, start + psz) : ctx;
  if (start >= end) {
    // A partition past the context is never read by the reduce kernel. An empty context (a padding row of a
    // CUDA-graph batch, say) gets a defined all-zero output instead of 0/0.
    pdl_enter();
    if (psz == 0)
      for (int i = threadIdx.x; i < group * D; i += kWarps * 32)
        static_cast<T*>(a.out)[s * a.out_stride_t + (kvh * group + i / D) * a.out_stride_h + i % D] = DType<T>::from_float(0.f);
    return;
  }

  const bool hi_rows = group > 8;  // rows 8..15 carry heads: only then is their softmax worth computing

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
  using C = CacheElem<T, CF>;
  float sl2 = a.scale * kLog2e;
  if constexpr (CF != kCacheNative) sl2 *= k_scale[kvh];

  const int64_t tok_stride = (int64_t)a.num_kv_heads * D;  // elements between consecutive slots
  const int* bt = a.block_tables + s * a.bt_stride;
  const C* kc = static_cast<const C*>(a.k_cache) + kvh * D;
  const C* vc = static_cast<const C*>(a.v_cache) + kvh * D;
  const int first = start / kChunk, last = (end + kChunk - 1) / kChunk;

  // Each warp streams every kWarps-th chunk of the partition through its own ring of S slots.
  constexpr int S = ring_stages<CF>();
  C* ring = reinterpret_cast<C*>(ring_smem) + warp * S * SLOT;
  const int ch0 = first + warp;
  const int mine = ch0 < last ? (last - ch0 + kWarps - 1) / kWarps : 0;  // chunks of this warp
  // The ring's first chunks are in flight before pdl_wait (they overlap the end of the kernel before this one),
  // except from the chunk holding the step's newest token (ctx - 1) on: that kernel writes it.
  const int fresh = (ctx - 1) / kChunk;
  int pre = 0;
  for (; pre < S - 1 && pre < mine && ch0 + pre * kWarps < fresh; ++pre) {
    const int tok = (ch0 + pre * kWarps) * kChunk;
    issue_any<T, D, BS, CF>(ring + pre * SLOT, kc, vc, bt[tok / BS], tok, end, lane, tok_stride);
    cp_async_commit();
  }
  pdl_enter();
  for (int i = pre; i < S - 1; ++i) {
    const int tok = (ch0 + i * kWarps) * kChunk;
    if (i < mine) issue_any<T, D, BS, CF>(ring + i * SLOT, kc, vc, bt[tok / BS], tok, end, lane, tok_stride);
    cp_async_commit();  // empty groups too: the wait count below stays uniform
  }

  // The group's query heads are the rows of the A operand (rows past the group are zero), read straight from
  // global memory in the fragment layout: this thread holds rows lane/4 and lane/4 + 8. Over an fp8 cache the
  // k order is the one fp8_scores reads K in: lane c's dims c * D/4 + 4 ks + {0..3} for k-step ks.
  const int r0 = lane / 4;
  uint32_t qa[KS][4];
  {
    const T* qb = static_cast<const T*>(a.q) + s * a.q_stride_t + (int64_t)kvh * group * a.q_stride_h;
    const T* q_lo = qb + r0 * a.q_stride_h;
    const T* q_hi = qb + (r0 + 8) * a.q_stride_h;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      if constexpr (CF == kCacheNative) {
        const int d = ks * 16 + (lane % 4) * 2;
        qa[ks][0] = q_pair(q_lo + d, r0 < group);
        qa[ks][1] = q_pair(q_hi + d, r0 + 8 < group);
        qa[ks][2] = q_pair(q_lo + d + 8, r0 < group);
        qa[ks][3] = q_pair(q_hi + d + 8, r0 + 8 < group);
      } else {
        const int d = (lane % 4) * (D / 4) + 4 * ks;
        const uint32_t l01 = q_pair(q_lo + d, r0 < group), l23 = q_pair(q_lo + d + 2, r0 < group);
        const uint32_t h01 = q_pair(q_hi + d, r0 + 8 < group), h23 = q_pair(q_hi + d + 2, r0 + 8 < group);
        if constexpr (kSplitPairs<T>) {  // dims (0, 2) and (1, 3)
          qa[ks][0] = __byte_perm(l01, l23, 0x5410), qa[ks][2] = __byte_perm(l01, l23, 0x7632);
          qa[ks][1] = __byte_perm(h01, h23, 0x5410), qa[ks][3] = __byte_perm(h01, h23, 0x7632);
        } else {
          qa[ks][0] = l01, qa[ks][2] = l23, qa[ks][1] = h01, qa[ks][3] = h23;
        }
      }
    }
  }
  uint32_t nan_bits = 0;  // fp8 with bf16 activations: bit 7 of a byte set once a K NaN was read
  for (int i = 0; i < mine; ++i) {
    const int j = i + S - 1;
    __syncwarp();  // every lane has read chunk i - 1 out of the slot refilled here
    if (j < mine) {
      const int tok = (ch0 + j * kWarps) * kChunk;
      issue_any<T, D, BS, CF>(ring + (j % S) * SLOT, kc, vc, bt[tok / BS], tok, end, lane, tok_stride);
    }
    cp_async_commit();
    cp_async_wait<S - 1>();  // this lane's copies of chunk i have landed ...
    __syncwarp();            // ... and, after this, every lane's
    const C* slot = ring + (i % S) * SLOT;
    const int tok0 = (ch0 + i * kWarps) * kChunk;

    float sc[2][4] = {};
    if constexpr (CF == kCacheNative) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t b[4];
        ldmatrix_x4(b, slot + swz<CH>((lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
        mma16816<T>(sc[0], qa[ks], b[0], b[1]);
        mma16816<T>(sc[1], qa[ks], b[2], b[3]);
      }
    } else {
      fp8_scores<T, D, CF>(slot, qa, lane, sc, nan_bits);
    }
    if (tok0 + kChunk > end) {  // the partition's last chunk: keys past its end do not count
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (tok0 + nt * 8 + (lane % 4) * 2 + (e & 1) >= end) sc[nt][e] = -CUDART_INF_F;
    }

    // Online softmax of the thread's rows; rows 8-15 only when the group reaches them.
    online_softmax_row<2, DT>(sc, o, mrow[0], lrow[0], sl2, 0);
    if (hi_rows) online_softmax_row<2, DT>(sc, o, mrow[1], lrow[1], sl2, 1);

    // The S accumulators of the two n-tiles are exactly the A fragment of one k-step of P V.
    using P = std::conditional_t<CF == kCacheNative, T, __half>;
    const uint32_t pa[4] = {DType<P>::from_float2(sc[0][0], sc[0][1]), DType<P>::from_float2(sc[0][2], sc[0][3]),
                            DType<P>::from_float2(sc[1][0], sc[1][1]), DType<P>::from_float2(sc[1][2], sc[1][3])};
    if constexpr (CF == kCacheNative) {
      const T* sV = slot + kChunk * D;
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sV + swz<CH>((lane & 7) + ((lane >> 3) & 1) * 8, 2 * dp + (lane >> 4)));
        mma16816<T>(o[2 * dp], pa, b[0], b[1]);
        mma16816<T>(o[2 * dp + 1], pa, b[2], b[3]);
      }
    } else {
      fp8_pv<D, CF>(slot, pa, lane, o);
    }
  }
  cp_async_wait<0>();
  // Every warp is out of its ring: the merge reuses that shared memory. (The vote is a plain barrier unless a
  // bf16-activation fp8 CTA read a NaN in K: its whole output is then NaN, as the reference's would be.)
  bool k_nan = false;
  if constexpr (CF != kCacheNative && kSplitPairs<T>)
    k_nan = __syncthreads_or((nan_bits & 0x80808080u) != 0);
  else
    __syncthreads();

  // Stage each warp's rows (acc [warp][head][D], then max and sum [warp][head]) and merge the warps.
  float* sm_acc = reinterpret_cast<float*>(ring_smem);
  float* sm_m = sm_acc + kWarps * kMaxGroup * D;
  float* sm_l = sm_m + kWarps * kMaxGroup;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int g = r0 + 8 * r;
    const float l = warp_sum_xor(lrow[r], 1, 4);
    if (g >= group) continue;
    float* acc = sm_acc + (warp * kMaxGroup + g) * D;
#pragma unroll
    for (int i = 0; i < DT; ++i) {  // n-tile i, column col at i * 8 + col: dim i * 8 + col, or (fp8) col * DT + i
      acc[i * 8 + (lane % 4) * 2] = o[i][2 * r];
      acc[i * 8 + (lane % 4) * 2 + 1] = o[i][2 * r + 1];
    }
    if (lane % 4 == 0) {
      sm_m[warp * kMaxGroup + g] = mrow[r];
      sm_l[warp * kMaxGroup + g] = l;
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < group * D; i += kWarps * 32) {
    const int g = i / D, d = i % D;
    // fp8 permutes the dims of P V (n-tile t, column n is dim n * DT + t): dim d was staged at (d % DT) * 8 + d / DT
    const int src = CF == kCacheNative ? d : (d % DT) * 8 + d / DT;
    float mmax = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mmax = fmaxf(mmax, sm_m[w * kMaxGroup + g]);
    float lsum = 0.f, o_d = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(sm_m[w * kMaxGroup + g] - mmax);  // 0 for a warp that saw no chunk (m = -inf)
      lsum += sm_l[w * kMaxGroup + g] * f;
      o_d += sm_acc[(w * kMaxGroup + g) * D + src] * f;
    }
    if constexpr (CF != kCacheNative) o_d = k_nan ? CUDART_NAN_F : o_d * v_scale[kvh];
    const int h = kvh * group + g;
    if (psz == 0) {
      T* op = static_cast<T*>(a.out) + s * a.out_stride_t + h * a.out_stride_h;
      op[d] = DType<T>::from_float(o_d / lsum);
    } else {
      const int64_t row = ((int64_t)s * a.num_q_heads + h) * gridDim.x + part;
      ws_out[row * D + d] = o_d / lsum;
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
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
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

template <typename T, int D, int BS, int CF>
cudaError_t launch_typed(const PagedAttnArgs& a, int partition_size, int num_partitions, float* ws_out,
                         float* ws_max, float* ws_sum, cudaStream_t stream, const float* ks, const float* vs) {
  static_assert(kWarps * (kMaxGroup * D + 2 * kMaxGroup) * 4 <= smem_bytes<D, CF>(), "merge buffer must fit the ring");
  if (a.num_q_heads / a.num_kv_heads > kMaxGroup) return cudaErrorInvalidValue;
  if (CF != kCacheNative && (ks == nullptr || vs == nullptr)) return cudaErrorInvalidValue;
  const dim3 grid(partition_size != 0 ? num_partitions : 1, a.num_kv_heads, a.num_seqs);
  constexpr int smem = smem_bytes<D, CF>();
  // Above 48 KB of dynamic shared memory a kernel must opt in. Set on every launch, so that it holds on whichever
  // device is current; it is a function attribute, not a stream operation, so launches can still be captured.
  const cudaError_t opt_in = cudaFuncSetAttribute(paged_decode_kernel<T, D, BS, CF>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (opt_in != cudaSuccess) return opt_in;
  const cudaError_t err = launch_kernel(paged_decode_kernel<T, D, BS, CF>, grid, dim3(kWarps * 32), smem, stream, a,
                                        partition_size, ws_out, ws_max, ws_sum, ks, vs);
  if (err != cudaSuccess || partition_size == 0) return err;
  const dim3 reduce_grid((a.num_q_heads + kReduceWarps - 1) / kReduceWarps, a.num_seqs);
  return launch_kernel(decode_reduce_kernel<T, D>, reduce_grid, dim3(kReduceWarps * 32), 0, stream, a,
                       partition_size, num_partitions, static_cast<const float*>(ws_out),
                       static_cast<const float*>(ws_max), static_cast<const float*>(ws_sum));
}

template <typename T, int CF>
cudaError_t dispatch_shape(const PagedAttnArgs& a, int ps, int np, float* wo, float* wm, float* wsum,
                           cudaStream_t st, const float* ks, const float* vs) {
  if (a.head_dim == 128 && a.block_size == 16) return launch_typed<T, 128, 16, CF>(a, ps, np, wo, wm, wsum, st, ks, vs);
  if (a.head_dim == 128 && a.block_size == 32) return launch_typed<T, 128, 32, CF>(a, ps, np, wo, wm, wsum, st, ks, vs);
  if (a.head_dim == 64 && a.block_size == 16) return launch_typed<T, 64, 16, CF>(a, ps, np, wo, wm, wsum, st, ks, vs);
  if (a.head_dim == 64 && a.block_size == 32) return launch_typed<T, 64, 32, CF>(a, ps, np, wo, wm, wsum, st, ks, vs);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t dispatch_cache(const PagedAttnArgs& a, int ps, int np, float* wo, float* wm, float* wsum,
                           cudaStream_t st, const KvQuant* q) {
  if (q == nullptr) return dispatch_shape<T, kCacheNative>(a, ps, np, wo, wm, wsum, st, nullptr, nullptr);
  switch (cache_format_of(q->cache_dtype, a.dtype)) {
    case kCacheE4M3: return dispatch_shape<T, kCacheE4M3>(a, ps, np, wo, wm, wsum, st, q->k_scale, q->v_scale);
    case kCacheE5M2: return dispatch_shape<T, kCacheE5M2>(a, ps, np, wo, wm, wsum, st, q->k_scale, q->v_scale);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_paged_decode(const PagedAttnArgs& a, int partition_size, int num_partitions, float* ws_out,
                                float* ws_max, float* ws_sum, cudaStream_t stream, const KvQuant* quant) {
  const bool fixed_ok = partition_size >= 0 && partition_size % 256 == 0;
  const bool equal_ok = partition_size < 0 && num_partitions == -partition_size;
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || !(fixed_ok || equal_ok) ||
      (partition_size != 0 && (num_partitions <= 0 || ws_out == nullptr)))
    return cudaErrorInvalidValue;
  if (a.num_seqs == 0) return cudaSuccess;
  if (a.dtype == ScalarType::kBFloat16)
    return dispatch_cache<__nv_bfloat16>(a, partition_size, num_partitions, ws_out, ws_max, ws_sum, stream, quant);
  if (a.dtype == ScalarType::kFloat16)
    return dispatch_cache<__half>(a, partition_size, num_partitions, ws_out, ws_max, ws_sum, stream, quant);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
