// Persistent decode kernel ("megakernel"): all decoder layers of one decode step in a single launch.
//
// What it computes: for B <= 16 sequences with one new token each, exactly what QwenForCausalLM.forward computes
// for a decode step (embedding, every layer's fused add + RMSNorm, QKV (+ bias), per-head q/k RMSNorm + neox
// RoPE, the KV-cache write of the new token, paged attention, o_proj, add + RMSNorm, gate_up + SwiGLU,
// down_proj, final add + RMSNorm), with the torch path's bf16 rounding points; its torch twin is the model's own
// torch path (minillm/ops/megakernel.py: reference_decode_step).
//
// Shape of the launch: one CTA of 8 warps per SM (cooperative launch, so every CTA is resident), 5 phases per
// layer separated by grid-wide barriers (a counter in global memory, zeroed by the launcher before each launch):
//   QKV   every CTA normalises the live rows of the residual stream itself (B x hidden, tiny) into a row-major
//         shared tile, then multiplies its own granules (8 weight rows each) of the QKV weight: mma.sync m16n8k16
//         with the batch as the 16 rows of A (ldmatrix from the tile) and 8 weight rows as B; output (+ bias) to a
//         row-major qkv buffer.
//   ATT   work items (sequence, KV head, context partition), partitions sized from the device-side seq_lens so the
//         items about fill the grid. An item applies q-norm + RoPE to its group's query heads; the item holding the
//         sequence's last position also makes the new k/v (k-norm + RoPE), stores them at slot_mapping and uses
//         them from shared memory. K/V chunks of 16 tokens stream through a per-warp cp.async ring; scores and
//         P V on tensor cores with an online softmax (as in paged_decode.cu). Split sequences: the last item to
//         finish (ticket counter) merges the partitions. Output in row-fragment order for o_proj.
//   O     o_proj over the CTA's granules, the live rows' A words straight from global memory into registers; the
//         epilogue adds the residual (residual stream updated in place by the owner of each row).
//   GU    add-free RMSNorm of the residual stream, gate/up granule pairs, SwiGLU in the epilogue -> row fragments.
//   DOWN  down_proj, residual add in the epilogue.
// No split-K anywhere: every output row is finished by one CTA, so results do not depend on timing.
// Weights do not depend on activations, so each phase's slice is bulk-copied (cp.async.bulk, completing on an
// mbarrier) into one of two shared-memory buffers as soon as the previous user of that buffer is done: QKV and
// GU alternate in buffer 0, O and DOWN in buffer 1, so every load overlaps at least one whole phase and its
// barriers. Every spin wait (grid barrier, mbarrier) is bounded by %globaltimer and traps with a message.
//
// Build: part of the one extension (minillm/ops/build.py); sm_90 only (bulk copies, mbarrier tx counts): the
// sm_80 build compiles an empty body and the launcher refuses older GPUs. Compile check without a GPU:
// scripts/compile_kernels.sh -v. Tests: tests/test_megakernel_gpu.py (GPU), tests/test_megakernel.py (the
// packing and partition arithmetic on the CPU), minillm/ops/megakernel_check.py (check-kernels).
#include <algorithm>
#include <cstdio>

#include "common.cuh"
#include "megakernel.h"

// The sm_80 pass compiles the kernel body out (the launcher refuses pre-sm_90 GPUs), which leaves its helpers
// unreferenced there.
#pragma nv_diag_suppress 177

namespace minillm {
namespace {
namespace mk {

constexpr int kWarps = kMegaThreads / 32;
constexpr int kChunk = 16;                     // tokens per attention step of a warp (one P V k-step)
constexpr int kMaxGran = kMegaMaxGranules;
constexpr int kRound = 8;                      // k-pairs of A fragments a warp holds in registers (O, DOWN)
constexpr int kMaxVec = kMegaMaxHidden / 8 / 32;  // 16-byte vectors per lane of a norm row
constexpr int kNormRows = kMegaMaxBatch / kWarps;  // rows of the residual stream one warp normalises
constexpr unsigned kBulkPiece = 16384;         // bytes per bulk-copy instruction
constexpr unsigned long long kTimeoutNs = 4000000000ull;  // a wait this long is a bug: trap loudly
constexpr int kTicketBase = 4;                 // sync words: [0] barrier counter, [4..] merge tickets
// The thread that issues the weight bulk copies: not thread 0, whose barrier release (a GPU-scope fence) then never
// has copies of its own in flight to wait for, whatever the hardware's fence does with them.
constexpr int kIssuer = 32;

// ---- element helpers (raw 16-bit patterns, so no implicit conversions are needed) ----------------------------
template <typename T> struct Elem;
template <> struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(uint32_t u16) { return __uint_as_float(u16 << 16); }
  static __device__ __forceinline__ uint32_t from_f(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
template <> struct Elem<__half> {
  static __device__ __forceinline__ float to_f(uint32_t u16) { return __half2float(__ushort_as_half((unsigned short)u16)); }
  static __device__ __forceinline__ uint32_t from_f(float x) { return __half_as_ushort(__float2half_rn(x)); }
};
template <typename T>
__device__ __forceinline__ float round_t(float x) { return Elem<T>::to_f(Elem<T>::from_f(x)); }
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) { return Elem<T>::from_f(lo) | (Elem<T>::from_f(hi) << 16); }
template <typename T>
__device__ __forceinline__ float lo_f(uint32_t u) { return Elem<T>::to_f(u & 0xffffu); }
template <typename T>
__device__ __forceinline__ float hi_f(uint32_t u) { return Elem<T>::to_f(u >> 16); }
// One element of a buffer other CTAs write during the launch: read through L2 (never a stale L1 line).
template <typename T>
__device__ __forceinline__ float ld_cg(const T* p) {
  return Elem<T>::to_f(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}
template <typename T>
__device__ __forceinline__ float ld_plain(const T* p) {
  return Elem<T>::to_f(*reinterpret_cast<const unsigned short*>(p));
}

// u32 index of the element pair (m, k), (m, k + 1) (k even) in a row-fragment buffer of width K (layout in
// megakernel.h): row m's 16 bytes for lane quad position q of k-pair k / 32 hold its A words of both k-steps.
__device__ __forceinline__ int64_t rowfrag_u32(int m, int k, int K) {
  return (((int64_t)m * (K / 32) + (k >> 5)) * 4 + ((k & 7) >> 1)) * 4 + ((k >> 4) & 1) * 2 + ((k >> 3) & 1);
}

// ---- sm_90 primitives ------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Timeline stamp `point` of `layer` (megakernel.h, kMegaProfPoints). Thread 0 only, after the CTA barrier that
// ends the step it marks, so the stamp is the CTA's slowest warp. kOn: the kernel variant built with stamps
// (launched when a buffer is given); the plain variant has none of this code.
template <bool kOn>
__device__ __forceinline__ void stamp(const MegakernelParams& p, int layer, int point) {
  if (kOn && threadIdx.x == 0) {
    unsigned long long* s = p.prof + ((int64_t)(layer * kMegaProfPoints + point) * gridDim.x + blockIdx.x) * 2;
    s[0] = clock64();
    s[1] = globaltimer();
  }
}

__device__ __noinline__ void fail(const char* what, int a, int b) {
  printf("minillm decode megakernel: %s (CTA %d, %d, %d); aborting\n", what, (int)blockIdx.x, a, b);
  __trap();
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, unsigned parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity, int what) {
  if (mbar_try_wait(bar, parity)) return;
  const unsigned long long t0 = globaltimer();
  while (!mbar_try_wait(bar, parity))
    if (globaltimer() - t0 > kTimeoutNs) fail("weight copy wait timed out", what, (int)parity);
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Thread kIssuer only: bulk-copy `bytes` (a multiple of 16, possibly 0) into a weight buffer, completing on `bar`.
// The buffer's previous readers finished before a __syncthreads; the proxy fence orders their generic-proxy
// reads before the async-proxy writes.
__device__ __forceinline__ void issue_weights(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect_tx(bar, bytes);
  for (unsigned off = 0; off < bytes; off += kBulkPiece)
    bulk_g2s(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, min(kBulkPiece, bytes - off), bar);
}

// A weight slice copied in pieces over several sync points instead of in one burst (thread kIssuer only; the state
// lives in shared memory). A burst of every CTA's slice puts 4-12 MB in front of every other load in the memory
// system for 1-3 us, and each grid barrier or L2 read that overlaps it waited that long (docs/megakernel.md,
// round 4): paced, at most kPacePieces x 16 KB per CTA and stream are in flight at a time.
struct Pending {
  const char* src;
  unsigned char* dst;
  uint64_t* bar;
  unsigned bytes, off;
};
constexpr unsigned kPacePieces = 2;  // 16 KB pieces per stream and sync point

// Starts a paced copy: the mbarrier expects all of it (plus `extra` bytes the caller copies itself) now.
__device__ __forceinline__ void pace_start(Pending& s, const void* src, unsigned char* dst, unsigned bytes,
                                           uint64_t* bar, unsigned extra) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect_tx(bar, bytes + extra);
  s.src = static_cast<const char*>(src), s.dst = dst, s.bar = bar, s.bytes = bytes, s.off = 0;
}

// The next `pieces` pieces of a paced copy (all of them: before its buffer is waited for).
__device__ __noinline__ void pace_pump(Pending* s, unsigned pieces) {
  for (; s->off < s->bytes && pieces > 0; --pieces) {
    const unsigned n = min(kBulkPiece, s->bytes - s->off);
    bulk_g2s(s->dst + s->off, s->src + s->off, n, s->bar);
    s->off += n;
  }
}

// Grid-wide barrier number `epoch` (1, 2, ...), in two halves so that work can be issued between them. Arrive:
// thread 0 adds one with release semantics (ordering every write the CTA made before the __syncthreads). Wait:
// thread 0 spins with acquire loads until all CTAs have arrived.
template <bool kOn>
__device__ __forceinline__ void grid_arrive(unsigned* counter, const MegakernelParams& p, int layer, int point) {
  __syncthreads();
  stamp<kOn>(p, layer, point);
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ void grid_wait(unsigned* counter, unsigned epoch) {
  if (threadIdx.x == 0) {
    const unsigned target = epoch * gridDim.x;
    unsigned seen;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    if (seen < target) {
      const unsigned long long t0 = globaltimer();
      unsigned spins = 0;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        if ((++spins & 255u) == 0 && globaltimer() - t0 > kTimeoutNs)
          fail("grid barrier timed out (a CTA is not resident or died)", (int)epoch, (int)seen);
      } while (seen < target);
    }
  }
  __syncthreads();
}

// Stamps `point` at the arrival and `point + 1` once the barrier is passed.
template <bool kOn>
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned epoch, const MegakernelParams& p, int layer,
                                             int point) {
  grid_arrive<kOn>(counter, p, layer, point);
  grid_wait(counter, epoch);
  stamp<kOn>(p, layer, point + 1);
}

// ---- shared memory -----------------------------------------------------------------------------------------------
struct AttnPlan {  // attention work split, computed once per launch from seq_lens (partition_plan in Python)
  int chunks_per_part;         // the largest partition, in 16-token chunks
  int items;
  int parts[kMegaMaxBatch];    // partitions of each sequence ...
  int len[kMegaMaxBatch];      // ... each this many chunks (the last one possibly shorter, never empty)
  int base[kMegaMaxBatch + 1];
  int last_flag;  // "this CTA merges the partitions": broadcast from thread 0
  // The step inputs an attention item needs (seq_lens, slot_mapping, positions), copied once per launch: read from
  // global memory in every layer they were dependent L2 round trips at the head of the attention phase (the grid
  // barrier's acquire invalidates L1), the context length gating all of an item's work.
  int ctx[kMegaMaxBatch];
  int64_t slot[kMegaMaxBatch];
  int64_t pos[kMegaMaxBatch];
};
// minillm/ops/megakernel.py (smem_plan) sizes this as 4 x (3 + 4 x 16 + 1) + 8 x 2 x 16 bytes.
static_assert(sizeof(AttnPlan) == 4 * (3 + 4 * kMegaMaxBatch + 1) + 8 * 2 * kMegaMaxBatch, "AttnPlan layout");

struct Phase;
struct Phases;

struct Smem {
  unsigned char* w0;   // QKV / GU weight slices
  unsigned char* w1;   // O / DOWN weight slices
  unsigned char* uni;  // norm output (A tile) | GEMV cross-warp sums | attention ring and merges
  unsigned char* qtile;
  unsigned char* nw;   // the layer's norm weight (ln1 with the QKV slice, ln2 with the GU slice), [hidden]
  uint64_t* bars;      // [2] mbarriers of w0 / w1
  Pending* pend;       // [2] the paced copies into w0 / w1
  Phases* ph;          // this CTA's weight slices (kept in shared memory, not in registers)
  AttnPlan* plan;
};

// ---- work split -------------------------------------------------------------------------------------------------
struct Range {
  int begin, end;
};
// CTA c's share of n granules: contiguous, sizes differing by at most one.
__device__ __forceinline__ Range split_range(int n) {
  const int c = blockIdx.x, N = gridDim.x;
  return {int((int64_t)c * n / N), int((int64_t)(c + 1) * n / N)};
}

// The attention partition plan (mirrored by minillm/ops/megakernel.py: partition_plan). Partitions hold whole
// 16-token chunks; the largest size `per` is chosen so that the items (sequence, KV head, partition) never
// outnumber the CTAs when they can all fit (then each CTA has at most one item, and split sequences fit the
// per-CTA partial rows); a sequence of c chunks is then cut into P = ceil(c / per) partitions of ceil(c / P)
// chunks (equal but for the last, which is never empty: (P - 1) * ceil(c / P) <= (P - 1) * per < c).
__device__ void make_plan(const MegakernelParams& p, AttnPlan* plan) {
  int chunks[kMegaMaxBatch];
  int64_t total = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int ctx = p.seq_lens[b];
    plan->ctx[b] = ctx;
    plan->slot[b] = p.slot_mapping[b];
    plan->pos[b] = p.positions[b];
    chunks[b] = ctx > 0 ? (ctx + kChunk - 1) / kChunk : 0;
    total += chunks[b];
  }
  const int64_t slack = (int64_t)gridDim.x - (int64_t)p.num_kv_heads * p.batch;
  int64_t per = 1 << 24;  // one partition per sequence
  if (slack > 0) {
    per = ((int64_t)p.num_kv_heads * total + slack - 1) / slack;
    per = max(per, (int64_t)max(p.min_partition_chunks, 1));
    per = min(per, (int64_t)1 << 24);
  }
  plan->chunks_per_part = (int)per;
  int base = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int parts = max(1, (int)((chunks[b] + per - 1) / per));
    plan->parts[b] = parts;
    plan->len[b] = (chunks[b] + parts - 1) / parts;
    plan->base[b] = base;
    base += parts * p.num_kv_heads;
  }
  plan->base[p.batch] = base;
  plan->items = base;
}

// ---- RMSNorm of the residual stream into the shared A tile --------------------------------------------------
// The A operand of the QKV and gate_up GEMVs lives in shared memory as a row-major tile of 16 rows of H + kActPad
// elements, read with ldmatrix (gemv_smem_a). The pad makes the row stride an odd number of 16-byte chunks
// (H % 16 == 0), so the 8 rows an ldmatrix phase addresses at one column fall in 8 different bank groups, and a
// warp writing 32 consecutive 16-byte chunks of one row is conflict-free too. (The first version stored fragment
// order with 4-byte stores, every row touching 8 of the 32 banks: 16-way conflicts, ~2 us per norm on every CTA.)
// Only rows < batch are written: the mma rows are independent, so whatever rows >= batch hold (the region is
// shared with the attention ring) only reaches output rows that no epilogue stores.
constexpr int kActPad = 8;
__host__ __device__ constexpr int act_stride(int H) { return H + kActPad; }
// Byte offset of the GEMV cross-warp sums (gemv_stage) in the shared union: after the A tile, not over it.
__host__ __device__ constexpr int red_offset(int H) { return (16 * act_stride(H) * 2 + 127) / 128 * 128; }

// What the norm reads of the launch's parameters, by value: a noinline function given a reference to the
// __grid_constant__ parameters reads them with generic loads, which miss after every grid barrier's L1
// invalidation (two dependent L2 round trips before the first row load, ~0.5 us per norm).
struct NormIn {
  void* resid;
  const void* embed;
  const int64_t* ids;
  int64_t vocab;
  int H, batch;
  float eps;
};

// Row m (< batch) of the source: the embedding of input_ids[m] (layer 0) or the residual stream. With from_embed,
// the CTA that owns row m (m % grid) stores the raw row as the residual stream (layer 0: the residual is the
// embedding).
template <typename T>
__device__ __noinline__ void norm_to_act(const NormIn in, bool from_embed, const T* weight, T* act) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int H = in.H, nvec = H / 8, AS = act_stride(H);
  if (warp >= in.batch) return;  // at B < 8 the idle warps go straight to the barrier
  // The norm weight does not depend on the row: its loads go out with (not after) the first row's.
  uint4 wv[kMaxVec];
#pragma unroll
  for (int j = 0; j < kMaxVec; ++j) {
    const int idx = lane + 32 * j;
    wv[j] = idx < nvec ? reinterpret_cast<const uint4*>(weight)[idx] : make_uint4(0, 0, 0, 0);
  }
  // A warp's rows (two at B > 8) are loaded together: one L2 round trip, not one per row. Out of line, the function
  // has the registers for both (inlined, two rows' registers spilled).
  uint4 v[kNormRows][kMaxVec];
  bool id_ok[kNormRows];
#pragma unroll
  for (int r = 0; r < kNormRows; ++r) {
    const int m = warp + r * kWarps;
    id_ok[r] = true;
    if (m >= in.batch) break;
    const T* row = static_cast<const T*>(in.resid) + (int64_t)m * H;
    if (from_embed) {
      const int64_t id = in.ids[m];
      id_ok[r] = id >= 0 && id < in.vocab;
      row = static_cast<const T*>(in.embed) + (id_ok[r] ? id : 0) * H;
    }
#pragma unroll
    for (int j = 0; j < kMaxVec; ++j) {
      const int idx = lane + 32 * j;
      v[r][j] = make_uint4(0, 0, 0, 0);
      if (idx < nvec) {
        const uint4* src = reinterpret_cast<const uint4*>(row) + idx;
        v[r][j] = from_embed ? *src : __ldcg(src);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kNormRows; ++r) {
    const int m = warp + r * kWarps;
    if (m >= in.batch) break;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxVec; ++j) {
      if (lane + 32 * j >= nvec) continue;
      const uint32_t w4[4] = {v[r][j].x, v[r][j].y, v[r][j].z, v[r][j].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float a = lo_f<T>(w4[e]), b = hi_f<T>(w4[e]);
        ss += a * a + b * b;
      }
    }
    ss = warp_sum_xor(ss, 1, 32);
    const float inv = id_ok[r] ? rsqrtf(ss / H + in.eps) : CUDART_NAN_F;
    const bool store_resid = from_embed && (m % (int)gridDim.x) == (int)blockIdx.x;
    uint4* dst = reinterpret_cast<uint4*>(act + m * AS);
#pragma unroll
    for (int j = 0; j < kMaxVec; ++j) {
      const int idx = lane + 32 * j;
      if (idx >= nvec) continue;
      if (store_resid) reinterpret_cast<uint4*>(static_cast<T*>(in.resid) + (int64_t)m * H)[idx] = v[r][j];
      const uint32_t x4[4] = {v[r][j].x, v[r][j].y, v[r][j].z, v[r][j].w},
                     g4[4] = {wv[j].x, wv[j].y, wv[j].z, wv[j].w};
      uint32_t o4[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)  // as rms_norm_ref: x * rsqrt(mean + eps), times the weight, one rounding
        o4[e] = pack2<T>(__fmul_rn(__fmul_rn(lo_f<T>(x4[e]), inv), lo_f<T>(g4[e])),
                         __fmul_rn(__fmul_rn(hi_f<T>(x4[e]), inv), hi_f<T>(g4[e])));
      dst[idx] = make_uint4(o4[0], o4[1], o4[2], o4[3]);
    }
  }
}

// ---- GEMV on tensor cores ---------------------------------------------------------------------------------------
// acc[g] (C fragment: rows = batch, columns = the granule's 8 weight rows) += A x W_g^T over one k-pair; a_lo and
// a_hi are the A registers of its two k-steps.
template <typename T>
__device__ __forceinline__ void mma_kpair(float (&acc)[kMaxGran][4], const uint32_t (&a_lo)[4],
                                          const uint32_t (&a_hi)[4], const uint4* w, int n_gran, int kpairs, int kp,
                                          int lane) {
#pragma unroll
  for (int g = 0; g < kMaxGran; ++g) {
    if (g < n_gran) {
      const uint4 b = w[((int64_t)g * kpairs + kp) * 32 + lane];
      mma16816<T>(acc[g], a_lo, b.x, b.y);
      mma16816<T>(acc[g], a_hi, b.z, b.w);
    }
  }
}

__device__ __forceinline__ void zero_acc(float (&acc)[kMaxGran][4]) {
#pragma unroll
  for (int g = 0; g < kMaxGran; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
}

// Stages every warp's accumulators in `red`, which lies after the A tile: no barrier is needed between a warp's
// last read of the tile and its stage (the previous readers of `red`, an epilogue, are a grid barrier back).
__device__ __forceinline__ void gemv_stage(const float (&acc)[kMaxGran][4], int n_gran, float4* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int g = 0; g < kMaxGran; ++g)
    if (g < n_gran) red[(warp * n_gran + g) * 32 + lane] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
}

// Each warp takes an equal share of the K dimension (in k-pairs = 32 columns) for all of the CTA's granules; the
// warps' partial sums are added in gemv_sum. Here A is the CTA's own norm output, the shared tile of norm_to_act:
// for ldmatrix.x4 lane l gives the address of row l % 16 at column 8 (l / 16) of the k-step, so its four 8x8
// matrices are rows 0-7 | 8-15 at k 0-7, then rows 0-7 | 8-15 at k 8-15: the A registers a0..a3 of m16n8k16.
// Out of line, one copy for QKV and gate_up (the kernel's loop must fit the instruction caches), staging its sums.
template <typename T>
__device__ __noinline__ void gemv_smem_a(const uint4* w, int n_gran, int kpairs, const T* act, int AS, float4* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc[kMaxGran][4];
  zero_acc(acc);
  const int kp_begin = warp * kpairs / kWarps, kp_end = (warp + 1) * kpairs / kWarps;
  const T* arow = act + (lane & 15) * AS + 8 * (lane >> 4);
  for (int kp = kp_begin; kp < kp_end && n_gran > 0; ++kp) {
    uint32_t lo[4], hi[4];
    ldmatrix_x4(lo, arow + 32 * kp);
    ldmatrix_x4(hi, arow + 32 * kp + 16);
    mma_kpair<T>(acc, lo, hi, w, n_gran, kpairs, kp, lane);
  }
  gemv_stage(acc, n_gran, red);
}

// As gemv_smem_a with A from a global row-fragment buffer another phase wrote (megakernel.h), read through L2 into
// registers, and the sums staged in `red` by the loop itself. Lane (g, q) loads row g's and row g + 8's 16 bytes of
// each k-pair: the A registers {a0, a2} and {a1, a3} of both k-steps. Rows >= batch are never read (the first version
// read all 16 rows on every CTA: 64 KB for o_proj, 96 KB for down at any B). At B <= 8 rows 8..15 are dead, so the
// registers of their words carry row g of the next kRound k-pairs instead: one round of loads covers 2 kRound
// k-pairs (down_proj of Qwen3-0.6B: 12 per warp, one L2 round trip instead of two). Their a1/a3 registers then hold
// other k-pairs' words: garbage that only reaches C rows 8..15, which no epilogue stores at B <= 8.
//
// Granules are a runtime loop (one accumulator, carried in `red` from one round of loads to the next, so every sum
// runs in k order as one register chain did): o_proj and down_proj have at most one or two granules per CTA, and
// the version unrolled over kMaxGran granules compiled to ~1,500 instructions per call site, most of them skipped
// and all of them fetched again every layer (the layer loop was larger than the instruction caches; round 4).
template <typename T>
__device__ __noinline__ void gemv_global_a(const uint4* w, int n_gran, int kpairs, const uint4* a, int batch,
                                           float4* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int kp_begin = warp * kpairs / kWarps, kp_end = (warp + 1) * kpairs / kWarps;
  if (kp_begin >= kp_end) {  // no k-pairs for this warp (K < 256): its share of every sum is zero
    for (int gi = 0; gi < n_gran; ++gi) red[(warp * n_gran + gi) * 32 + lane] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  const bool narrow = batch <= 8;
  const bool live0 = g < batch, live8 = narrow ? live0 : g + 8 < batch;
  const uint4* row0 = a + (int64_t)g * kpairs * 4 + q;
  const uint4* row8 = narrow ? row0 : a + (int64_t)(g + 8) * kpairs * 4 + q;
  const int second = narrow ? kRound : 0;  // k-pair offset of the words in f8
#pragma unroll 1
  for (int kp0 = kp_begin; kp0 < kp_end; kp0 += kRound + second) {
    uint4 f0[kRound], f8[kRound];
#pragma unroll
    for (int i = 0; i < kRound; ++i) {
      f0[i] = f8[i] = make_uint4(0, 0, 0, 0);
      if (live0 && kp0 + i < kp_end) f0[i] = __ldcg(row0 + (int64_t)(kp0 + i) * 4);
      if (live8 && kp0 + second + i < kp_end) f8[i] = __ldcg(row8 + (int64_t)(kp0 + second + i) * 4);
    }
#pragma unroll 1
    for (int gi = 0; gi < n_gran; ++gi) {
      float4* slot = red + (warp * n_gran + gi) * 32 + lane;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      if (kp0 != kp_begin) {
        const float4 c = *slot;
        acc[0] = c.x, acc[1] = c.y, acc[2] = c.z, acc[3] = c.w;
      }
      const uint4* wg = w + (int64_t)gi * kpairs * 32 + lane;
#pragma unroll
      for (int i = 0; i < kRound; ++i) {
        if (kp0 + i < kp_end) {
          const uint4 b = wg[(kp0 + i) * 32];
          const uint32_t lo[4] = {f0[i].x, f8[i].x, f0[i].y, f8[i].y};
          const uint32_t hi[4] = {f0[i].z, f8[i].z, f0[i].w, f8[i].w};
          mma16816<T>(acc, lo, b.x, b.y);
          mma16816<T>(acc, hi, b.z, b.w);
        }
      }
      if (narrow) {
#pragma unroll
        for (int i = 0; i < kRound; ++i) {
          if (kp0 + kRound + i < kp_end) {
            const uint4 b = wg[(kp0 + kRound + i) * 32];
            const uint32_t lo[4] = {f8[i].x, f0[i].x, f8[i].y, f0[i].y};
            const uint32_t hi[4] = {f8[i].z, f0[i].z, f8[i].w, f0[i].w};
            mma16816<T>(acc, lo, b.x, b.y);
            mma16816<T>(acc, hi, b.z, b.w);
          }
        }
      }
      *slot = make_float4(acc[0], acc[1], acc[2], acc[3]);
    }
  }
}

// Sum of granule g's fragment `lane` over the warps, in warp order (deterministic).
__device__ __forceinline__ float4 gemv_sum(const float4* red, int n_gran, int g, int lane) {
  float4 s = red[g * 32 + lane];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    const float4 t = red[(w * n_gran + g) * 32 + lane];
    s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
  }
  return s;
}

// ---- phases ------------------------------------------------------------------------------------------------------
struct Phase {  // the weight slice of one GEMV phase for this CTA
  Range gran;       // granules (GU: gate/up pairs)
  int64_t offset;   // elements from the layer's start
  unsigned bytes;
};

// The four slices of a CTA, computed once and kept in shared memory: registers are the kernel's scarcest resource
// (255 per thread), and spilled values would live in an L1 of ~28 KB next to 227 KB of shared memory.
struct Phases {
  Phase qkv, o, gu, down;
};

__device__ __forceinline__ Phase slice(int granules, int64_t granule_elems) {
  const Range r = split_range(granules);
  return {r, r.begin * granule_elems, (unsigned)((r.end - r.begin) * granule_elems * 2)};
}

struct Dims {
  int H, I, D, Hq, Hkv, G, Nqkv, Kq;
  __device__ explicit Dims(const MegakernelParams& p)
      : H(p.hidden), I(p.inter), D(p.head_dim), Hq(p.num_heads), Hkv(p.num_kv_heads), G(p.num_heads / p.num_kv_heads),
        Nqkv((p.num_heads + 2 * p.num_kv_heads) * p.head_dim), Kq(p.num_heads * p.head_dim) {}
  __device__ Phase qkv() const { return slice(Nqkv / 8, 8LL * H); }
  __device__ Phase o() const { return slice(H / 8, 8LL * Kq); }
  __device__ Phase gu() const { return slice(I / 8, 16LL * H); }
  __device__ Phase down() const { return slice(H / 8, 8LL * I); }
};

template <typename T>
__device__ __forceinline__ void issue(const void* base, int64_t layer_elems, int layer, const Phase& ph,
                                      unsigned char* buf, uint64_t* bar) {
  issue_weights(buf, static_cast<const T*>(base) + layer * layer_elems + ph.offset, ph.bytes, bar);
}

// A QKV or GU slice and, on the same mbarrier, the norm weight its phase starts with (`norm` [L][hidden] into
// sm.nw): the norm then reads shared memory after the slice's wait instead of HBM after a grid barrier.
template <typename T>
__device__ __forceinline__ void issue_normed(const void* base, int64_t layer_elems, int layer, const Phase& ph,
                                             unsigned char* buf, uint64_t* bar, const void* norm, int H,
                                             unsigned char* nw) {
  const unsigned nbytes = unsigned(H) * sizeof(T);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect_tx(bar, ph.bytes + nbytes);
  const char* src = reinterpret_cast<const char*>(static_cast<const T*>(base) + layer * layer_elems + ph.offset);
  for (unsigned off = 0; off < ph.bytes; off += kBulkPiece)
    bulk_g2s(buf + off, src + off, min(kBulkPiece, ph.bytes - off), bar);
  bulk_g2s(nw, static_cast<const T*>(norm) + (int64_t)layer * H, nbytes, bar);
}

// Paced versions of issue / issue_normed: the slice's pieces follow at pace_pump calls; the norm weight (2-4 KB)
// goes at once.
template <typename T>
__device__ __forceinline__ void pace(Pending& s, const void* base, int64_t layer_elems, int layer, const Phase& ph,
                                     unsigned char* buf, uint64_t* bar) {
  pace_start(s, static_cast<const T*>(base) + layer * layer_elems + ph.offset, buf, ph.bytes, bar, 0);
}
template <typename T>
__device__ __forceinline__ void pace_normed(Pending& s, const void* base, int64_t layer_elems, int layer,
                                            const Phase& ph, unsigned char* buf, uint64_t* bar, const void* norm,
                                            int H, unsigned char* nw) {
  const unsigned nbytes = unsigned(H) * sizeof(T);
  pace_start(s, static_cast<const T*>(base) + layer * layer_elems + ph.offset, buf, ph.bytes, bar, nbytes);
  bulk_g2s(nw, static_cast<const T*>(norm) + (int64_t)layer * H, nbytes, bar);
}

// Epilogue of QKV: bias (Qwen2), one rounding, row-major qkv buffer.
template <typename T>
__device__ void qkv_epilogue(const MegakernelParams& p, const Dims& d, int layer, const Phase& ph, const float4* red) {
  const int n_gran = ph.gran.end - ph.gran.begin;
  const T* bias = p.b_qkv ? static_cast<const T*>(p.b_qkv) + (int64_t)layer * d.Nqkv : nullptr;
  for (int t = threadIdx.x; t < n_gran * 32; t += kMegaThreads) {
    const int g = t / 32, lane = t % 32;
    const float4 c = gemv_sum(red, n_gran, g, lane);
    const int r = (ph.gran.begin + g) * 8 + 2 * (lane % 4), m0 = lane / 4;
    const float b0 = bias ? ld_plain(bias + r) : 0.f, b1 = bias ? ld_plain(bias + r + 1) : 0.f;
    if (m0 < p.batch)
      *reinterpret_cast<uint32_t*>(static_cast<T*>(p.qkv) + (int64_t)m0 * d.Nqkv + r) = pack2<T>(c.x + b0, c.y + b1);
    if (m0 + 8 < p.batch)
      *reinterpret_cast<uint32_t*>(static_cast<T*>(p.qkv) + (int64_t)(m0 + 8) * d.Nqkv + r) = pack2<T>(c.z + b0, c.w + b1);
  }
}

// O and DOWN add their output to the residual stream rows they own (the same rows in both phases). Thread t
// (< granules x 32) handles C fragment t % 32 of granule t / 32: rows m0 = lane / 4 and m0 + 8 of the batch, two
// adjacent columns. Its old residual values are loaded at the start of the phase, so that round trip overlaps the
// A-fragment loads instead of following the GEMV.
static_assert(kMaxGran * 32 <= kMegaThreads, "one epilogue fragment per thread");

template <typename T>
__device__ __forceinline__ void resid_prefetch(const MegakernelParams& p, const Dims& d, const Phase& ph,
                                               uint32_t (&old)[2]) {
  const int t = threadIdx.x, lane = t % 32, m0 = lane / 4;
  old[0] = old[1] = 0;
  if (t >= (ph.gran.end - ph.gran.begin) * 32) return;
  const int r = (ph.gran.begin + t / 32) * 8 + 2 * (lane % 4);
  const uint32_t* base = reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.resid) + r);
  if (m0 < p.batch) old[0] = __ldcg(base + (int64_t)m0 * d.H / 2);
  if (m0 + 8 < p.batch) old[1] = __ldcg(base + (int64_t)(m0 + 8) * d.H / 2);
}

// y rounded, then residual row += y, rounded (as the torch path's x + residual), in place.
template <typename T>
__device__ void residual_epilogue(const MegakernelParams& p, const Dims& d, const Phase& ph, const float4* red,
                                  const uint32_t (&old)[2]) {
  const int n_gran = ph.gran.end - ph.gran.begin, t = threadIdx.x, lane = t % 32;
  if (t >= n_gran * 32) return;
  const float4 c = gemv_sum(red, n_gran, t / 32, lane);
  const int r = (ph.gran.begin + t / 32) * 8 + 2 * (lane % 4), m0 = lane / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m0 + 8 * h;
    if (m >= p.batch) continue;
    uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<T*>(p.resid) + (int64_t)m * d.H + r);
    const float y0 = round_t<T>(h ? c.z : c.x), y1 = round_t<T>(h ? c.w : c.y);
    *dst = pack2<T>(y0 + lo_f<T>(old[h]), y1 + hi_f<T>(old[h]));
  }
}

// Epilogue of GU: gate and up rounded, silu(gate) rounded, times up, rounded (as silu_and_mul) -> h fragments.
template <typename T>
__device__ void swiglu_epilogue(const MegakernelParams& p, const Phase& ph, const float4* red) {
  const int n_pairs = ph.gran.end - ph.gran.begin, n_gran = 2 * n_pairs;
  uint32_t* h = static_cast<uint32_t*>(p.h_frag);
  for (int t = threadIdx.x; t < n_pairs * 32; t += kMegaThreads) {
    const int j = t / 32, lane = t % 32;
    const float4 gs = gemv_sum(red, n_gran, 2 * j, lane), us = gemv_sum(red, n_gran, 2 * j + 1, lane);
    const float g4[4] = {gs.x, gs.y, gs.z, gs.w}, u4[4] = {us.x, us.y, us.z, us.w};
    float y[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float g = round_t<T>(g4[e]), u = round_t<T>(u4[e]);
      y[e] = __fmul_rn(round_t<T>(g / (1.f + expf(-g))), u);
    }
    const int i = (ph.gran.begin + j) * 8 + 2 * (lane % 4), m0 = lane / 4;
    if (m0 < p.batch) h[rowfrag_u32(m0, i, p.inter)] = pack2<T>(y[0], y[1]);
    if (m0 + 8 < p.batch) h[rowfrag_u32(m0 + 8, i, p.inter)] = pack2<T>(y[2], y[3]);
  }
}

// ---- attention ---------------------------------------------------------------------------------------------------
template <int D>
struct Att {
  static constexpr int CH = D / 8;       // 16-byte pieces per head row
  static constexpr int KS = D / 16;      // k-steps of Q K^T
  static constexpr int DT = D / 8;       // n-tiles of P V
  static constexpr int S = 128 / D;      // ring slots per warp (the ring is 64 KB whatever D is)
  static constexpr int SLOT = 2 * kChunk * D;  // elements: K rows then V rows of one chunk
  static constexpr int QS = D + 8;       // padded row of the Q tile (elements)
};

// Query heads of the group -> normalised (Qwen3), RoPE'd, rounded rows of the Q tile (rows past the group zero);
// with `kv`, also the new token's k (normalised, RoPE'd) and v into the stash, and into their cache slot.
// Rounding as qk_norm_rope: the normalised head is rounded, RoPE runs in fp32 on it (products rounded
// separately) and is rounded once.
template <typename T, int D>
__device__ void attn_prep(const MegakernelParams& p, const Dims& d, int layer, int b, int64_t pos, int kvh, bool kv,
                          int64_t slot, T* sq, T* stash) {
  constexpr int PE = D / 64;  // rotation pairs per lane
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool pos_ok = pos >= 0 && pos < p.max_positions;
  const float* cs = p.cos_sin + (pos_ok ? pos : 0) * D;
  const T* row = static_cast<const T*>(p.qkv) + (int64_t)b * d.Nqkv;
  // Tasks: query heads 0..15 (rows of the tile; past the group: zero), then k (16) and v (17) when kv. Warp w
  // takes the w-th, (w + 8)-th, ... task of the order (the group's heads, k, v, the zero rows), so the tasks that
  // load from global memory fall on different warps while there are at most 8 of them (Qwen3-0.6B: 2 heads + k
  // + v): one L2 round trip per warp, not two in a row.
  const int tasks = kv ? 18 : 16, real = d.G + (kv ? 2 : 0);
  for (int t = warp; t < tasks; t += kWarps) {
    const int task = t < d.G ? t : t < real ? 16 + (t - d.G) : d.G + (t - real);
    const bool is_q = task < 16, is_v = task == 17;
    if (is_q && task >= d.G) {
      for (int i = lane; i < D; i += 32) reinterpret_cast<uint16_t*>(sq)[task * Att<D>::QS + i] = 0;
      continue;
    }
    const T* src = is_q ? row + (kvh * d.G + task) * D : row + d.Kq + (is_v ? d.Hkv * D : 0) + kvh * D;
    float x1[PE], x2[PE];
#pragma unroll
    for (int e = 0; e < PE; ++e) {
      x1[e] = ld_cg(src + lane + 32 * e);
      x2[e] = ld_cg(src + D / 2 + lane + 32 * e);
    }
    if (!is_v) {
      const T* nw = static_cast<const T*>(is_q ? p.q_norm : p.k_norm);
      if (nw != nullptr) {
        nw += (int64_t)layer * D;
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < PE; ++e) ss += x1[e] * x1[e] + x2[e] * x2[e];
        const float inv = rsqrtf(warp_sum_xor(ss, 1, 32) / D + p.eps);
#pragma unroll
        for (int e = 0; e < PE; ++e) {
          x1[e] = round_t<T>(__fmul_rn(__fmul_rn(x1[e], inv), ld_plain(nw + lane + 32 * e)));
          x2[e] = round_t<T>(__fmul_rn(__fmul_rn(x2[e], inv), ld_plain(nw + D / 2 + lane + 32 * e)));
        }
      }
#pragma unroll
      for (int e = 0; e < PE; ++e) {
        const float c = cs[lane + 32 * e], s = cs[D / 2 + lane + 32 * e];
        const float y1 = __fsub_rn(__fmul_rn(x1[e], c), __fmul_rn(x2[e], s));
        const float y2 = __fadd_rn(__fmul_rn(x2[e], c), __fmul_rn(x1[e], s));
        x1[e] = pos_ok ? y1 : CUDART_NAN_F;
        x2[e] = pos_ok ? y2 : CUDART_NAN_F;
      }
    }
    uint16_t* dst = reinterpret_cast<uint16_t*>(is_q ? sq + task * Att<D>::QS : stash + (is_v ? D : 0));
    uint16_t* cache = nullptr;
    if (!is_q) {
      void* base = is_v ? p.v_cache[layer] : p.k_cache[layer];
      cache = reinterpret_cast<uint16_t*>(static_cast<T*>(base) + (slot * d.Hkv + kvh) * D);
    }
#pragma unroll
    for (int e = 0; e < PE; ++e) {
      const uint16_t a = (uint16_t)Elem<T>::from_f(x1[e]), c = (uint16_t)Elem<T>::from_f(x2[e]);
      dst[lane + 32 * e] = a;
      dst[D / 2 + lane + 32 * e] = c;
      if (cache) {
        cache[lane + 32 * e] = a;
        cache[D / 2 + lane + 32 * e] = c;
      }
    }
  }
}

// Where one attention item works: sequence b, KV head kvh, tokens [start, end) of partition `part` of `parts`,
// and this warp's chunks (every kWarps-th 16-token chunk from ch0, `mine` of them). The item that holds the
// sequence's last position makes the new token's k/v (slot >= 0; a padded row, slot -1, reads its last position
// from the cache like the torch path): that token is then taken from the stash, never read from the cache, so no
// CTA reads a slot written during this phase.
struct Item {
  int b, kvh, part, parts, ctx, start, end, ch0, mine, stash_pos;
  int64_t slot;
  const int* bt;
};

__device__ __forceinline__ Item locate_item(const MegakernelParams& p, const AttnPlan& plan, int item) {
  Item it;
  it.b = 0;
  while (it.b + 1 < p.batch && plan.base[it.b + 1] <= item) ++it.b;
  it.parts = plan.parts[it.b];
  const int r = item - plan.base[it.b];
  it.kvh = r / it.parts;
  it.part = r % it.parts;
  it.ctx = max(plan.ctx[it.b], 0);
  const int64_t span = (int64_t)plan.len[it.b] * kChunk;
  it.start = (int)min((int64_t)it.part * span, (int64_t)it.ctx);
  it.end = (int)min((int64_t)it.start + span, (int64_t)it.ctx);
  it.slot = it.part == it.parts - 1 ? plan.slot[it.b] : -1;
  it.stash_pos = it.slot >= 0 ? it.ctx - 1 : -1;
  const int warp = threadIdx.x / 32, first = it.start / kChunk, last = (it.end + kChunk - 1) / kChunk;
  it.ch0 = first + warp;
  it.mine = it.ch0 < last ? (last - it.ch0 + kWarps - 1) / kWarps : 0;
  it.bt = p.block_tables + (int64_t)it.b * p.bt_stride;
  return it;
}

// Start the copy of this warp's j-th chunk of the item into ring slot j % S (as paged_decode.cu's issue_chunk),
// and commit it as one cp.async group (an empty group when the warp has no j-th chunk, so counts stay uniform).
// Tokens past `end` and the stash token are zero-filled without a read (the stash token is written in later).
template <typename T, int D>
__device__ __forceinline__ void issue_chunk(const MegakernelParams& p, const Dims& d, int layer, const Item& it, int j,
                                            T* ring, int lane) {
  using A = Att<D>;
  constexpr int CH = A::CH, PIECES = 2 * kChunk * CH / 32;
  if (j < it.mine) {
    T* slot = ring + (j % A::S) * A::SLOT;
    const int tok0 = (it.ch0 + j * kWarps) * kChunk, bs_shift = __ffs(p.block_size) - 1, bsz = p.block_size;
    const int64_t slot0 = (int64_t)it.bt[tok0 >> bs_shift] * bsz + (tok0 & (bsz - 1));
    const int64_t tok_stride = (int64_t)d.Hkv * D;
    const T* kc = static_cast<const T*>(p.k_cache[layer]) + it.kvh * D;
    const T* vc = static_cast<const T*>(p.v_cache[layer]) + it.kvh * D;
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
      const int pc = lane + 32 * i, row = pc / CH, c = pc % CH, t = row % kChunk;
      const bool valid = tok0 + t < it.end && tok0 + t != it.stash_pos;
      const T* base = row < kChunk ? kc : vc;
      cp_async16(slot + swz<CH>(row, c), valid ? base + (slot0 + t) * tok_stride + c * 8 : base, valid ? 16 : 0);
    }
  }
  cp_async_commit();
}

// The ring's first S chunks of this warp. Called before the item's q/k/v exist (even before the grid barrier that
// publishes them): the cached K/V of earlier tokens do not depend on this step.
template <typename T, int D>
__device__ __forceinline__ void attn_prologue(const MegakernelParams& p, const Dims& d, int layer, const Item& it,
                                              const Smem& sm) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* ring = reinterpret_cast<T*>(sm.uni) + warp * Att<D>::S * Att<D>::SLOT;
#pragma unroll
  for (int j = 0; j < Att<D>::S; ++j) issue_chunk<T, D>(p, d, layer, it, j, ring, lane);
}

// Writes dims dd, dd + 1 of query head `head` of sequence b into the row fragments of o_proj's input.
template <typename T>
__device__ __forceinline__ void store_attn(void* attn_frag, int kq, int b, int head, int D, int dd, float y0, float y1) {
  static_cast<uint32_t*>(attn_frag)[rowfrag_u32(b, head * D + dd, kq)] = pack2<T>(y0, y1);
}

// Merge the P partitions of (b, kvh) (their partial rows are items first .. first + P - 1) into the output.
template <typename T, int D>
__device__ __noinline__ void merge_partitions(const float* partials, void* attn_frag, int kq, int G, int b, int kvh,
                                              int first, int parts, float* sw) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, RS = D + 2;
  float* sl = sw + G * parts;  // [G] the merged sums
  float* sp = sl + G;          // [G * parts] each partition's sum, kept from the one read of (max, sum)
  for (int j = warp; j < G; j += kWarps) {
    // One L2 round trip for (max, sum) of every partition (adjacent floats, 8-byte aligned: RS and D are even);
    // a lane later reads back only the entries it wrote itself, so no synchronisation is needed in between.
    float mx = -CUDART_INF_F;
    for (int q = lane; q < parts; q += 32) {
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(partials + ((int64_t)(first + q) * G + j) * RS + D));
      sw[j * parts + q] = ml.x;
      sp[j * parts + q] = ml.y;
      mx = fmaxf(mx, ml.x);
    }
    mx = warp_max_xor(mx, 1, 32);
    float lsum = 0.f;
    for (int q = lane; q < parts; q += 32) {
      const float w = exp2f(sw[j * parts + q] - mx);
      sw[j * parts + q] = w;
      lsum += sp[j * parts + q] * w;
    }
    lsum = warp_sum_xor(lsum, 1, 32);
    if (lane == 0) sl[j] = lsum;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < G * D / 2; t += kMegaThreads) {
    const int j = t / (D / 2), dd = 2 * (t % (D / 2));
    float o0 = 0.f, o1 = 0.f;
    for (int q = 0; q < parts; ++q) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(partials + ((int64_t)(first + q) * G + j) * RS + dd));
      const float w = sw[j * parts + q];
      o0 += v.x * w;
      o1 += v.y * w;
    }
    store_attn<T>(attn_frag, kq, b, kvh * G + j, D, dd, o0 / sl[j], o1 / sl[j]);
  }
}

// One attention item. `prefetched`: attn_prologue already ran for it (before the grid barrier).
template <typename T, int D>
__device__ void attention_item(const MegakernelParams& p, const Dims& d, int layer, const Smem& sm, int item,
                               bool prefetched) {
  using A = Att<D>;
  const AttnPlan& plan = *sm.plan;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = d.G;
  const Item it = locate_item(p, plan, item);
  if (it.start >= it.end) {  // an empty context (never a real row): a defined all-zero output
    if (it.parts != 1) fail("empty attention partition", item, it.parts);
    cp_async_wait<0>();      // (a prefetch issued nothing for it)
    for (int t = threadIdx.x; t < G * D / 2; t += kMegaThreads)
      store_attn<T>(p.attn_frag, d.Kq, it.b, it.kvh * G + t / (D / 2), D, 2 * (t % (D / 2)), 0.f, 0.f);
    return;
  }
  if (!prefetched) attn_prologue<T, D>(p, d, layer, it, sm);
  T* sq = reinterpret_cast<T*>(sm.qtile);
  T* stash = sq + kMegaMaxBatch * A::QS;
  attn_prep<T, D>(p, d, layer, it.b, plan.pos[it.b], it.kvh, it.slot >= 0, it.slot, sq, stash);
  __syncthreads();

  // Q as the A operand (rows = the group's heads), from the tile.
  const int r0 = lane / 4;
  uint32_t qa[A::KS][4];
#pragma unroll
  for (int ks = 0; ks < A::KS; ++ks) {
    const int c = ks * 16 + (lane % 4) * 2;
    qa[ks][0] = *reinterpret_cast<const uint32_t*>(sq + r0 * A::QS + c);
    qa[ks][1] = *reinterpret_cast<const uint32_t*>(sq + (r0 + 8) * A::QS + c);
    qa[ks][2] = *reinterpret_cast<const uint32_t*>(sq + r0 * A::QS + c + 8);
    qa[ks][3] = *reinterpret_cast<const uint32_t*>(sq + (r0 + 8) * A::QS + c + 8);
  }
  float o[A::DT][4];
#pragma unroll
  for (int i = 0; i < A::DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;
  T* ring = reinterpret_cast<T*>(sm.uni) + warp * A::S * A::SLOT;
  for (int i = 0; i < it.mine; ++i) {
    cp_async_wait<A::S - 1>();  // this lane's copies of chunk i have landed ...
    __syncwarp();               // ... and, after this, every lane's
    T* sK = ring + (i % A::S) * A::SLOT;
    const T* sV = sK + kChunk * D;
    const int tok0 = (it.ch0 + i * kWarps) * kChunk;
    if (it.stash_pos >= tok0 && it.stash_pos < tok0 + kChunk) {  // the new token's K and V rows, from the stash
      const int t = it.stash_pos - tok0;
      if (lane < 2 * A::CH) {
        const int row = lane < A::CH ? t : kChunk + t, c = lane % A::CH;
        *reinterpret_cast<uint4*>(sK + swz<A::CH>(row, c)) =
            reinterpret_cast<const uint4*>(stash + (lane < A::CH ? 0 : D))[c];
      }
      __syncwarp();
    }
    float sc[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < A::KS; ++ks) {
      uint32_t bb[4];
      ldmatrix_x4(bb, sK + swz<A::CH>((lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
      mma16816<T>(sc[0], qa[ks], bb[0], bb[1]);
      mma16816<T>(sc[1], qa[ks], bb[2], bb[3]);
    }
    if (tok0 + kChunk > it.end) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (tok0 + nt * 8 + (lane % 4) * 2 + (e & 1) >= it.end) sc[nt][e] = -CUDART_INF_F;
    }
    online_softmax_row<2, A::DT>(sc, o, mrow[0], lrow[0], sl2, 0);
    if (G > 8) online_softmax_row<2, A::DT>(sc, o, mrow[1], lrow[1], sl2, 1);
    const uint32_t pa[4] = {DType<T>::from_float2(sc[0][0], sc[0][1]), DType<T>::from_float2(sc[0][2], sc[0][3]),
                            DType<T>::from_float2(sc[1][0], sc[1][1]), DType<T>::from_float2(sc[1][2], sc[1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t bb[4];
      ldmatrix_x4_trans(bb, sV + swz<A::CH>((lane & 7) + ((lane >> 3) & 1) * 8, 2 * dp + (lane >> 4)));
      mma16816<T>(o[2 * dp], pa, bb[0], bb[1]);
      mma16816<T>(o[2 * dp + 1], pa, bb[2], bb[3]);
    }
    __syncwarp();  // every lane is done with slot i % S before it is refilled
    issue_chunk<T, D>(p, d, layer, it, i + A::S, ring, lane);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is out of its ring: the warp merge reuses it

  float* sm_acc = reinterpret_cast<float*>(sm.uni);
  float* sm_m = sm_acc + kWarps * G * D;
  float* sm_l = sm_m + kWarps * G;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int g = r0 + 8 * rr;
    const float l = warp_sum_xor(lrow[rr], 1, 4);
    if (g >= G) continue;
    float* acc = sm_acc + (warp * G + g) * D + (lane % 4) * 2;
#pragma unroll
    for (int i = 0; i < A::DT; ++i) {
      acc[i * 8] = o[i][2 * rr];
      acc[i * 8 + 1] = o[i][2 * rr + 1];
    }
    if (lane % 4 == 0) {
      sm_m[warp * G + g] = mrow[rr];
      sm_l[warp * G + g] = l;
    }
  }
  __syncthreads();

  const int RS = D + 2;
  if (it.parts > 1 && item >= (int)gridDim.x) fail("attention item has no partial row", item, it.parts);
  for (int t = threadIdx.x; t < G * D / 2; t += kMegaThreads) {
    const int g = t / (D / 2), dd = 2 * (t % (D / 2));
    float mmax = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mmax = fmaxf(mmax, sm_m[w * G + g]);
    float lsum = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(sm_m[w * G + g] - mmax);  // 0 for a warp that saw no chunk (m = -inf)
      lsum += sm_l[w * G + g] * f;
      o0 += sm_acc[(w * G + g) * D + dd] * f;
      o1 += sm_acc[(w * G + g) * D + dd + 1] * f;
    }
    if (it.parts == 1) {
      store_attn<T>(p.attn_frag, d.Kq, it.b, it.kvh * G + g, D, dd, o0 / lsum, o1 / lsum);
    } else {
      float* row = p.partials + ((int64_t)item * G + g) * RS;
      *reinterpret_cast<float2*>(row + dd) = make_float2(o0, o1);
      if (dd == 0) {
        row[D] = mmax;
        row[D + 1] = lsum;
      }
    }
  }
  if (it.parts == 1) return;

  // Split sequence: the last of its P items to get here merges them (threadFenceReduction pattern).
  unsigned* ticket = p.sync + kTicketBase + it.b * d.Hkv + it.kvh;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned prev = atomicAdd(ticket, 1u);
    sm.plan->last_flag = prev == (unsigned)it.parts - 1;
  }
  __syncthreads();
  if (sm.plan->last_flag) {
    __threadfence();
    merge_partitions<T, D>(p.partials, p.attn_frag, d.Kq, d.G, it.b, it.kvh, plan.base[it.b] + it.kvh * it.parts, it.parts,
                           reinterpret_cast<float*>(sm.uni));
    if (threadIdx.x == 0) *ticket = 0;  // ready for the next layer (after at least one grid barrier)
  }
}

template <typename T>
__device__ void final_norm(const MegakernelParams& p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, H = p.hidden, nvec = H / 8;
#pragma unroll 1
  for (int m = blockIdx.x * kWarps + warp; m < p.batch; m += gridDim.x * kWarps) {
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const T*>(p.resid) + (int64_t)m * H);
    uint4 v[kMaxVec];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxVec; ++j) {
      const int idx = lane + 32 * j;
      v[j] = idx < nvec ? __ldcg(row + idx) : make_uint4(0, 0, 0, 0);
      const uint32_t w4[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) ss += lo_f<T>(w4[e]) * lo_f<T>(w4[e]) + hi_f<T>(w4[e]) * hi_f<T>(w4[e]);
    }
    const float inv = rsqrtf(warp_sum_xor(ss, 1, 32) / H + p.eps);
#pragma unroll
    for (int j = 0; j < kMaxVec; ++j) {
      const int idx = lane + 32 * j;
      if (idx >= nvec) continue;
      const uint4 wv = reinterpret_cast<const uint4*>(p.final_norm)[idx];
      const uint32_t x4[4] = {v[j].x, v[j].y, v[j].z, v[j].w}, g4[4] = {wv.x, wv.y, wv.z, wv.w};
      uint32_t o4[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        o4[e] = pack2<T>(__fmul_rn(__fmul_rn(lo_f<T>(x4[e]), inv), lo_f<T>(g4[e])),
                         __fmul_rn(__fmul_rn(hi_f<T>(x4[e]), inv), hi_f<T>(g4[e])));
      reinterpret_cast<uint4*>(static_cast<T*>(p.out) + (int64_t)m * H)[idx] = make_uint4(o4[0], o4[1], o4[2], o4[3]);
    }
  }
}

template <typename T, int D, bool kStamps>
__global__ void __launch_bounds__(kMegaThreads, 1)
    decode_megakernel(const __grid_constant__ MegakernelParams p, const MegakernelSmemPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem sm;
  sm.w0 = smem_raw;
  sm.w1 = sm.w0 + plan.w0;
  sm.uni = sm.w1 + plan.w1;
  sm.qtile = sm.uni + plan.uni;
  sm.nw = sm.qtile + plan.qtile;
  sm.bars = reinterpret_cast<uint64_t*>(sm.nw + plan.nw);
  sm.pend = reinterpret_cast<Pending*>(sm.bars + 2);
  sm.ph = reinterpret_cast<Phases*>(sm.pend + 2);
  sm.plan = reinterpret_cast<AttnPlan*>(sm.ph + 1);
  const Dims d(p);
  const Phases& ph = *sm.ph;
  const int64_t qkv_layer = (int64_t)d.Nqkv * d.H, o_layer = (int64_t)d.H * d.Kq, gu_layer = 2LL * d.I * d.H,
                down_layer = (int64_t)d.H * d.I;
  unsigned* counter = p.sync;
  unsigned epoch = 0;
  unsigned parity[2] = {0, 0};
  // Stamped variant only: each slice issued right before its wait (kMegaProfSerialWeights), a diagnosis.
  const bool serial = kStamps && (p.prof_flags & kMegaProfSerialWeights);
  const bool issuer = threadIdx.x == kIssuer;
  const NormIn nin{p.resid, p.embed, p.input_ids, p.vocab_size, p.hidden, p.batch, p.eps};

  if (threadIdx.x == kIssuer) {
    *sm.ph = Phases{d.qkv(), d.o(), d.gu(), d.down()};
    mbar_init(&sm.bars[0]);
    mbar_init(&sm.bars[1]);
    sm.pend[0] = sm.pend[1] = Pending{nullptr, nullptr, nullptr, 0, 0};
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if (!serial) {
      issue_normed<T>(p.w_qkv, qkv_layer, 0, sm.ph->qkv, sm.w0, &sm.bars[0], p.ln1, d.H, sm.nw);
      issue<T>(p.w_o, o_layer, 0, sm.ph->o, sm.w1, &sm.bars[1]);
    }
  }
  if (threadIdx.x == 0) make_plan(p, sm.plan);
  __syncthreads();
  T* act = reinterpret_cast<T*>(sm.uni);
  const int AS = act_stride(d.H);
  // The GEMV sums sit after the A tile, so a warp stages its sums while others may still read the tile.
  float4* red = reinterpret_cast<float4*>(sm.uni + red_offset(d.H));

  for (int layer = 0; layer < p.num_layers; ++layer) {
    const bool more = layer + 1 < p.num_layers;
    if (layer == 0) stamp<kStamps>(p, 0, 0);  // later layers: stamped as the previous layer's last barrier is passed
    // QKV: wait for the slice (and ln1 with it: copied a phase ago, it has landed); norm -> A tile in shared
    // memory; GEMV on buffer 0; then buffer 0 takes GU's slice.
    if (serial && issuer) issue_normed<T>(p.w_qkv, qkv_layer, layer, ph.qkv, sm.w0, &sm.bars[0], p.ln1, d.H, sm.nw);
    if (issuer) {
      pace_pump(&sm.pend[0], ~0u);  // whatever is left of the QKV slice (none at the default pace)
      pace_pump(&sm.pend[1], kPacePieces);
    }
    mbar_wait(&sm.bars[0], parity[0], 0);
    parity[0] ^= 1;
    stamp<kStamps>(p, layer, 1);
    norm_to_act<T>(nin, layer == 0, reinterpret_cast<const T*>(sm.nw), act);
    __syncthreads();
    stamp<kStamps>(p, layer, 2);
    gemv_smem_a<T>(reinterpret_cast<const uint4*>(sm.w0), ph.qkv.gran.end - ph.qkv.gran.begin, d.H / 32, act, AS,
                   red);
    __syncthreads();  // every warp is done with buffer 0 and has staged its sums
    stamp<kStamps>(p, layer, 3);
    if (issuer && !serial) {
      pace_normed<T>(sm.pend[0], p.w_gu, gu_layer, layer, ph.gu, sm.w0, &sm.bars[0], p.ln2, d.H, sm.nw);
      pace_pump(&sm.pend[0], kPacePieces);
      pace_pump(&sm.pend[1], kPacePieces);
    }
    qkv_epilogue<T>(p, d, layer, ph.qkv, red);
    // The first attention item's K/V chunks start streaming while the CTA waits at the barrier (the ring aliases
    // `red`, which grid_arrive's __syncthreads retires; issued after the arrival so the release cannot wait on them).
    grid_arrive<kStamps>(counter, p, layer, 4);
    if ((int)blockIdx.x < sm.plan->items) attn_prologue<T, D>(p, d, layer, locate_item(p, *sm.plan, blockIdx.x), sm);
    grid_wait(counter, ++epoch);
    stamp<kStamps>(p, layer, 5);
    if (issuer) {
      pace_pump(&sm.pend[0], kPacePieces);
      pace_pump(&sm.pend[1], kPacePieces);
    }

    // Attention.
    for (int item = blockIdx.x; item < sm.plan->items; item += gridDim.x) {
      attention_item<T, D>(p, d, layer, sm, item, item == (int)blockIdx.x);
      __syncthreads();
    }
    grid_barrier<kStamps>(counter, ++epoch, p, layer, 6);

    // O: A from the global row fragments; then buffer 1 takes DOWN's slice.
    uint32_t old_resid[2];
    resid_prefetch<T>(p, d, ph.o, old_resid);
    if (serial && issuer) issue<T>(p.w_o, o_layer, layer, ph.o, sm.w1, &sm.bars[1]);
    if (issuer) {
      pace_pump(&sm.pend[1], ~0u);
      pace_pump(&sm.pend[0], kPacePieces);
    }
    mbar_wait(&sm.bars[1], parity[1], 1);
    parity[1] ^= 1;
    stamp<kStamps>(p, layer, 8);
    gemv_global_a<T>(reinterpret_cast<const uint4*>(sm.w1), ph.o.gran.end - ph.o.gran.begin, d.Kq / 32,
                     static_cast<const uint4*>(p.attn_frag), p.batch, red);
    __syncthreads();
    stamp<kStamps>(p, layer, 9);
    if (issuer && !serial) {
      pace<T>(sm.pend[1], p.w_down, down_layer, layer, ph.down, sm.w1, &sm.bars[1]);
      pace_pump(&sm.pend[1], kPacePieces);
      pace_pump(&sm.pend[0], kPacePieces);
    }
    residual_epilogue<T>(p, d, ph.o, red, old_resid);
    grid_barrier<kStamps>(counter, ++epoch, p, layer, 10);

    // GU: wait for the slice (and ln2 with it); norm -> A tile; gate/up pairs on buffer 0; then buffer 0 takes the
    // next layer's QKV slice.
    if (serial && issuer) issue_normed<T>(p.w_gu, gu_layer, layer, ph.gu, sm.w0, &sm.bars[0], p.ln2, d.H, sm.nw);
    if (issuer) {
      pace_pump(&sm.pend[0], ~0u);
      pace_pump(&sm.pend[1], kPacePieces);
    }
    mbar_wait(&sm.bars[0], parity[0], 2);
    parity[0] ^= 1;
    stamp<kStamps>(p, layer, 12);
    norm_to_act<T>(nin, false, reinterpret_cast<const T*>(sm.nw), act);
    __syncthreads();
    stamp<kStamps>(p, layer, 13);
    const int gu_gran = 2 * (ph.gu.gran.end - ph.gu.gran.begin);
    gemv_smem_a<T>(reinterpret_cast<const uint4*>(sm.w0), gu_gran, d.H / 32, act, AS, red);
    __syncthreads();
    stamp<kStamps>(p, layer, 14);
    if (issuer && !serial) {
      if (more) pace_normed<T>(sm.pend[0], p.w_qkv, qkv_layer, layer + 1, ph.qkv, sm.w0, &sm.bars[0], p.ln1, d.H, sm.nw);
      pace_pump(&sm.pend[0], kPacePieces);
      pace_pump(&sm.pend[1], kPacePieces);
    }
    swiglu_epilogue<T>(p, ph.gu, red);
    grid_barrier<kStamps>(counter, ++epoch, p, layer, 15);

    // DOWN: A from the global row fragments; then buffer 1 takes the next layer's O slice.
    resid_prefetch<T>(p, d, ph.down, old_resid);
    if (serial && issuer) issue<T>(p.w_down, down_layer, layer, ph.down, sm.w1, &sm.bars[1]);
    if (issuer) {
      pace_pump(&sm.pend[1], ~0u);
      pace_pump(&sm.pend[0], kPacePieces);
    }
    mbar_wait(&sm.bars[1], parity[1], 3);
    parity[1] ^= 1;
    stamp<kStamps>(p, layer, 17);
    gemv_global_a<T>(reinterpret_cast<const uint4*>(sm.w1), ph.down.gran.end - ph.down.gran.begin, d.I / 32,
                     static_cast<const uint4*>(p.h_frag), p.batch, red);
    __syncthreads();
    stamp<kStamps>(p, layer, 18);
    if (issuer && !serial) {
      if (more) pace<T>(sm.pend[1], p.w_o, o_layer, layer + 1, ph.o, sm.w1, &sm.bars[1]);
      pace_pump(&sm.pend[1], kPacePieces);
      pace_pump(&sm.pend[0], kPacePieces);
    }
    residual_epilogue<T>(p, d, ph.down, red, old_resid);
    // Its second stamp (point 20) is the next layer's point 0 (after the last layer: overwritten by the final one).
    grid_barrier<kStamps>(counter, ++epoch, p, layer, 19);
  }
  final_norm<T>(p);
  if (kStamps) {
    __syncthreads();
    stamp<kStamps>(p, p.num_layers, 0);  // the pair after the last layer's points
  }
#endif
}

int ceil_div(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }
int round_up(int64_t a, int64_t b) { return (int)((a + b - 1) / b * b); }

}  // namespace mk
}  // namespace

cudaError_t megakernel_smem_plan(const MegakernelParams& p, MegakernelSmemPlan* plan) {
  using namespace mk;
  const int H = p.hidden, I = p.inter, D = p.head_dim, Hq = p.num_heads, Hkv = p.num_kv_heads, N = p.num_ctas;
  const bool pow2_bs = p.block_size >= kChunk && (p.block_size & (p.block_size - 1)) == 0;
  if (N < 1 || p.batch < 1 || p.batch > kMegaMaxBatch || p.num_layers < 1 || p.num_layers > kMegaMaxLayers ||
      (D != 64 && D != 128) || Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > 16 || H < 32 || H % 32 != 0 ||
      H > kMegaMaxHidden || I < 32 || I % 32 != 0 || !pow2_bs)
    return cudaErrorInvalidValue;
  const int G = Hq / Hkv, Nqkv = (Hq + 2 * Hkv) * D, Kq = Hq * D;
  const int gq = ceil_div(Nqkv / 8, N), gp = ceil_div(I / 8, N), go = ceil_div(H / 8, N);
  if (std::max(std::max(gq, 2 * gp), go) > kMaxGran) return cudaErrorInvalidValue;
  plan->w0 = round_up(2LL * std::max(gq * 8LL * H, gp * 16LL * H), 128);
  plan->w1 = round_up(2LL * std::max(go * 8LL * Kq, go * 8LL * I), 128);
  const int64_t act = 16LL * act_stride(H) * 2;
  const int64_t red = red_offset(H) + (int64_t)kWarps * std::max(std::max(gq, 2 * gp), go) * 32 * 16;
  const int64_t ring = (int64_t)kWarps * (128 / D) * 2 * kChunk * D * 2;
  const int64_t warp_merge = (int64_t)kWarps * G * D * 4 + 2LL * kWarps * G * 4;
  const int64_t part_merge = 2LL * G * kMegaMaxPartitions * 4 + G * 4;
  plan->uni = round_up(std::max(std::max(act, red), std::max(ring, std::max(warp_merge, part_merge))), 128);
  plan->qtile = round_up(2LL * (kMegaMaxBatch * (D + 8) + 2 * D), 128);
  plan->misc = round_up(2 * 8 + 2 * (int64_t)sizeof(Pending) + (int64_t)sizeof(Phases) + (int64_t)sizeof(AttnPlan),
                        128);
  plan->nw = round_up(2LL * H, 128);
  plan->total = plan->w0 + plan->w1 + plan->uni + plan->qtile + plan->misc + plan->nw;
  return cudaSuccess;
}

namespace {
template <typename T, int D, bool kStamps>
cudaError_t launch_variant(const MegakernelParams& p, const MegakernelSmemPlan& plan, cudaStream_t stream) {
  auto kernel = mk::decode_megakernel<T, D, kStamps>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.total);
  if (err != cudaSuccess) return err;
  // Registers and shared memory must fit one CTA per SM. Asked once per variant and size, so that launches during
  // CUDA-graph capture (always preceded by an eager one in minillm) make no occupancy query.
  static int verified_smem = -1;
  if (verified_smem != plan.total) {
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kMegaThreads, plan.total);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) return cudaErrorInvalidValue;
    verified_smem = plan.total;
  }
  err = cudaMemsetAsync(p.sync, 0, sizeof(unsigned) * megakernel_sync_words(p.num_kv_heads), stream);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_ctas);
  cfg.blockDim = dim3(kMegaThreads);
  cfg.dynamicSmemBytes = plan.total;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.cooperative ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p, plan);
}

// The variant with timeline stamps only when a buffer is given: the stamps' branches are not in the fast kernel.
template <typename T, int D>
cudaError_t launch_typed(const MegakernelParams& p, const MegakernelSmemPlan& plan, cudaStream_t stream) {
  return p.prof != nullptr ? launch_variant<T, D, true>(p, plan, stream) : launch_variant<T, D, false>(p, plan, stream);
}
}  // namespace

cudaError_t launch_decode_megakernel(const MegakernelParams& p, cudaStream_t stream) {
  int dev = 0, major = 0, sms = 0, smem_optin = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return err;
  if (major < 9) return cudaErrorNotSupported;
  MegakernelSmemPlan plan;
  err = megakernel_smem_plan(p, &plan);
  if (err != cudaSuccess) return err;
  if (p.num_ctas > sms || plan.total > smem_optin || p.sync == nullptr || p.partials == nullptr) return cudaErrorInvalidValue;
  if (p.dtype == ScalarType::kBFloat16) return p.head_dim == 128 ? launch_typed<__nv_bfloat16, 128>(p, plan, stream)
                                             : launch_typed<__nv_bfloat16, 64>(p, plan, stream);
  if (p.dtype == ScalarType::kFloat16) return p.head_dim == 128 ? launch_typed<__half, 128>(p, plan, stream)
                                             : launch_typed<__half, 64>(p, plan, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
