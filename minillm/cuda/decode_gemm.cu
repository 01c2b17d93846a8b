// Decode GEMM: y[M, N] = x[M, K] * w[N, K]^T for decode batches (M <= 256) on Hopper, weight-streaming.
//
// Why: at decode sizes the product is a weight read (Qwen3-0.6B: 2-12 MB per GEMM, 1-3 us of HBM) with a little
// math on the side. cuBLAS spends 5-8 us per call there and takes no part in programmatic dependent launch, so no
// weight byte moves before the kernel in front of it has ended. The weights are constants, so this kernel starts
// streaming them before `griddepcontrol.wait`; only the activations x (the previous kernel's output) wait.
//
// Math: y^T = w x^T on mma.sync m16n8k16 with w as the A operand (16 weight rows fill the mma's M side) and x as B
// (tiny M fills n8), fp32 accumulators. At M <= 64 this is far from the tensor-core bound; at M = 256 mma.sync
// gets close to it (see docs/kernels.md).
//
// Tiling: a CTA owns BN weight rows (64 for x tiles of MT <= 32 rows, 128 for MT = 64 / 128; MT picked from M,
// grid y covers M beyond 128) and one of `splits` contiguous k-tile ranges (grid z = cluster z = rank). Warps are
// WROW x WCOL over the BN x MT output tile (4 x 1 for MT <= 32: 128 threads; 4 x 2 for MT >= 64: 256 threads).
//
// Ring: STAGES (6, 5 for MT = 128) stages of a BN x 64 weight tile and an MT x 64 x tile, rows padded to 144 bytes
// (16-byte shift per row: ldmatrix's 8 rows land in 8 different bank groups, no swizzle needed, so each row is
// one 128-byte cp.async.bulk straight from global memory). Each stage has an mbarrier whose transaction count is
// armed with the weight and x bytes of the stage; warp 0 issues the copies (a row per lane per step), everybody
// waits on the barrier's phase. Bytes in flight per CTA: 6 x 64 x 128 = 48 KB of weights at BN = 64 (2-3 CTAs per
// SM), 96 KB at BN = 128 (1 per SM) - against ~30 KB per SM needed to cover HBM latency at 3.8 TB/s.
//
// PDL prologue: warp 0 arms every stage's barrier for its weight + x bytes and issues the weight rows of the first
// STAGES k-tiles; then all threads `griddepcontrol.wait` (x is read and y written only after it: y may reuse a
// buffer the previous kernel still reads), `launch_dependents`, and warp 0 issues the x rows of those stages.
// The main loop refills the stage consumed one iteration earlier after a __syncthreads (every warp is past it).
//
// Split-K: no workspace and no second kernel. Each CTA leaves its fp32 partial tile in its own shared memory (the
// ring's space, as [MT][BN + 4]), a cluster barrier, then rank r sums its slice of the tile's rows over all ranks
// through distributed shared memory and writes them; a second cluster barrier keeps the partial tiles alive.
// Rows of the x tile past M are never loaded: their garbage only reaches output columns that are never stored.
#include <cooperative_groups.h>

#include "common.cuh"
#include "decode_gemm.h"
#include "launch.h"

namespace minillm {
namespace {

namespace cg = cooperative_groups;

constexpr int kTK = kDecodeGemmTileK;
constexpr int kRowStride = kTK + 8;  // elements per smem row: 144 bytes
constexpr int kBarBytes = 128;       // the stage barriers, ahead of the ring

template <int MT>
struct Tiling {
  static constexpr int BN = MT >= 64 ? 128 : 64;  // weight rows per CTA
  static constexpr int WROW = 4, WCOL = MT >= 64 ? 2 : 1;
  static constexpr int THREADS = 32 * WROW * WCOL;
  static constexpr int WTN = BN / WROW, WTM = MT / WCOL;  // warp tile: weight rows x x rows
  static constexpr int MF = WTN / 16, NF = WTM / 8;       // m16 (weight) and n8 (x) fragments per warp
  static constexpr int STAGES = MT >= 128 ? 5 : 6;
  static constexpr int STAGE = (BN + MT) * kRowStride;    // elements: weight rows, then x rows
  static constexpr int PIPE_BYTES = STAGES * STAGE * 2;
  static constexpr int RED_STRIDE = BN + 4;               // floats per row of the partial tile
  static constexpr int RED_BYTES = MT * RED_STRIDE * 4;
  static constexpr int SMEM = kBarBytes + (PIPE_BYTES > RED_BYTES ? PIPE_BYTES : RED_BYTES);
  static_assert(MF >= 1 && NF % 2 == 0, "warp tile must hold whole fragments");
  static_assert(STAGES * 8 <= kBarBytes, "barriers must fit their slot");
  static_assert(SMEM <= 227 * 1024, "over the opt-in shared memory of a CTA");
};

// ---- mbarrier and bulk-copy primitives (sm_90) ------------------------------------------------------------

[[maybe_unused]] __device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// One arrival (the barrier's only one per phase) that also adds `bytes` to the phase's expected transactions.
[[maybe_unused]] __device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

[[maybe_unused]] __device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from global to this CTA's shared memory; completion is
// counted on bar's transaction count.
[[maybe_unused]] __device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Everything a CTA needs to address its slab. x and w point at the slab's first element (row m0 / n0, its first
// k-tile); k-tile t of the slab starts at column t * kTK.
template <typename T>
struct Slab {
  const T* x;
  int64_t ldx;
  const T* w;
  int64_t ldw;
  int rows;  // valid x rows of this CTA's tile
};

[[maybe_unused]] constexpr uint32_t kRowBytes = kTK * 2;

// Warp 0: weight rows of k-tile t into stage `st` (a row per lane per step).
template <typename T, int MT>
__device__ __forceinline__ void issue_w(const Slab<T>& s, T* stage, int t, uint64_t* bar, int lane) {
  for (int r = lane; r < Tiling<MT>::BN; r += 32)
    bulk_copy(stage + r * kRowStride, s.w + r * s.ldw + t * kTK, kRowBytes, bar);
}

template <typename T, int MT>
__device__ __forceinline__ void issue_x(const Slab<T>& s, T* stage, int t, uint64_t* bar, int lane) {
  T* sx = stage + Tiling<MT>::BN * kRowStride;
  for (int r = lane; r < s.rows; r += 32) bulk_copy(sx + r * kRowStride, s.x + r * s.ldx + t * kTK, kRowBytes, bar);
}

template <typename T, int MT>
__device__ __forceinline__ uint32_t stage_bytes(const Slab<T>& s) {
  return (Tiling<MT>::BN + s.rows) * kRowBytes;
}

// acc += the warp's BN x MT sub-tile of one stage (64 of K).
template <typename T, int MT>
__device__ __forceinline__ void compute_stage(float (&acc)[Tiling<MT>::MF][Tiling<MT>::NF][4], const T* stage,
                                              int wr, int wc, int lane) {
  using Tl = Tiling<MT>;
  const T* sw = stage + wr * Tl::WTN * kRowStride;
  const T* sx = stage + (Tl::BN + wc * Tl::WTM) * kRowStride;
#pragma unroll
  for (int ks = 0; ks < kTK / 16; ++ks) {
    uint32_t af[Tl::MF][4];
#pragma unroll
    for (int mf = 0; mf < Tl::MF; ++mf)
      ldmatrix_x4(af[mf], sw + (mf * 16 + (lane & 15)) * kRowStride + (2 * ks + (lane >> 4)) * 8);
#pragma unroll
    for (int np = 0; np < Tl::NF / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, sx + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * kRowStride + (2 * ks + ((lane >> 3) & 1)) * 8);
#pragma unroll
      for (int mf = 0; mf < Tl::MF; ++mf) {
        mma16816<T>(acc[mf][2 * np], af[mf], b[0], b[1]);
        mma16816<T>(acc[mf][2 * np + 1], af[mf], b[2], b[3]);
      }
    }
  }
}

template <typename T, int MT>
__global__ void __launch_bounds__(Tiling<MT>::THREADS)
    decode_gemm_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w, int64_t ldw,
                       T* __restrict__ y, int64_t ldy, int M, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Tl = Tiling<MT>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw);
  T* ring = reinterpret_cast<T*>(smem_raw + kBarBytes);
  cg::cluster_group cluster = cg::this_cluster();
  const int splits = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int n0 = blockIdx.x * Tl::BN, m0 = blockIdx.y * MT;
  const int total_kt = K / kTK;
  const int kt0 = rank * total_kt / splits, n_kt = (rank + 1) * total_kt / splits - kt0;
  const Slab<T> s{x + m0 * ldx + kt0 * kTK, ldx, w + n0 * ldw + kt0 * kTK, ldw, min(MT, M - m0)};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp % Tl::WROW, wc = warp / Tl::WROW;
  const int pro = min(n_kt, Tl::STAGES);

  if (threadIdx.x == 0) {
    for (int i = 0; i < Tl::STAGES; ++i) mbar_init(bars + i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // Weights first: constants, so they may stream while the kernel before this one is still running.
  if (warp == 0)
    for (int t = 0; t < pro; ++t) {
      if (lane == 0) mbar_arrive_expect_tx(bars + t, stage_bytes<T, MT>(s));
      __syncwarp();  // armed before any of its bytes can land (a transient negative count is legal, but unneeded)
      issue_w<T, MT>(s, ring + t * Tl::STAGE, t, bars + t, lane);
    }
  pdl_wait();     // x is the previous kernel's output; y may be memory it still reads
  pdl_trigger();  // the next kernel may be scheduled (it waits for this grid's end in its own pdl_wait)
  if (warp == 0)
    for (int t = 0; t < pro; ++t) issue_x<T, MT>(s, ring + t * Tl::STAGE, t, bars + t, lane);

  float acc[Tl::MF][Tl::NF][4];
#pragma unroll
  for (int i = 0; i < Tl::MF; ++i)
#pragma unroll
    for (int j = 0; j < Tl::NF; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  for (int kt = 0; kt < n_kt; ++kt) {
    const int st = kt % Tl::STAGES;
    mbar_wait(bars + st, (kt / Tl::STAGES) & 1);
    __syncthreads();  // every warp is done with k-tile kt - 1: its stage may be refilled
    const int refill = kt - 1 + Tl::STAGES;
    if (warp == 0 && kt >= 1 && refill < n_kt) {
      const int rs = (kt - 1) % Tl::STAGES;
      T* stage = ring + rs * Tl::STAGE;
      // The stage was last read through the generic proxy (ldmatrix); order that before the async-proxy writes.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      if (lane == 0) mbar_arrive_expect_tx(bars + rs, stage_bytes<T, MT>(s));
      __syncwarp();
      issue_w<T, MT>(s, stage, refill, bars + rs, lane);
      issue_x<T, MT>(s, stage, refill, bars + rs, lane);
    }
    compute_stage<T, MT>(acc, ring + st * Tl::STAGE, wr, wc, lane);
  }
  __syncthreads();  // the ring's space becomes this CTA's partial tile

  // Partial tile as [x row][weight row]: output rows of y are contiguous in N.
  float* red = reinterpret_cast<float*>(smem_raw + kBarBytes);
#pragma unroll
  for (int mf = 0; mf < Tl::MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < Tl::NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = wr * Tl::WTN + mf * 16 + lane / 4 + (e >> 1) * 8;
        const int m = wc * Tl::WTM + nf * 8 + (lane % 4) * 2 + (e & 1);
        red[m * Tl::RED_STRIDE + n] = acc[mf][nf][e];
      }
  cluster.sync();  // every rank's partial tile is complete and visible to the cluster

  // Rank r sums x rows [r * MT / splits, (r + 1) * MT / splits) over all ranks, 4 columns per thread and step; the
  // remote loads of all ranks are issued before any is summed (each is a round trip to another SM).
  const int r_begin = rank * MT / splits, r_end = min((rank + 1) * MT / splits, s.rows);
  constexpr int C4 = Tl::BN / 4;
  for (int i = threadIdx.x; i < (r_end - r_begin) * C4; i += Tl::THREADS) {
    const int r = r_begin + i / C4, c = (i % C4) * 4;
    float4 part[kDecodeGemmMaxSplits];
#pragma unroll
    for (int q = 0; q < kDecodeGemmMaxSplits; ++q)
      if (q < splits)
        part[q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(red, q) + r * Tl::RED_STRIDE + c);
    float4 sum = part[0];
#pragma unroll
    for (int q = 1; q < kDecodeGemmMaxSplits; ++q)
      if (q < splits) {
        sum.x += part[q].x;
        sum.y += part[q].y;
        sum.z += part[q].z;
        sum.w += part[q].w;
      }
    uint2 out;
    out.x = DType<T>::from_float2(sum.x, sum.y);
    out.y = DType<T>::from_float2(sum.z, sum.w);
    *reinterpret_cast<uint2*>(y + (m0 + r) * ldy + n0 + c) = out;
  }
  cluster.sync();  // keep this CTA's shared memory alive until every rank has read it
#else
  pdl_enter();  // never launched below sm_90 (the launcher refuses), but keep the PDL contract
#endif
}

template <typename T, int MT>
cudaError_t launch_tiled(const T* x, int64_t ldx, const T* w, int64_t ldw, T* y, int64_t ldy, int M, int N, int K,
                         int splits, cudaStream_t stream) {
  using Tl = Tiling<MT>;
  const cudaError_t opt_in =
      cudaFuncSetAttribute(decode_gemm_kernel<T, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, Tl::SMEM);
  if (opt_in != cudaSuccess) return opt_in;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = splits;
  return launch_kernel_with(&cluster, 1, decode_gemm_kernel<T, MT>, dim3(N / Tl::BN, (M + MT - 1) / MT, splits),
                            dim3(Tl::THREADS), Tl::SMEM, stream, x, ldx, w, ldw, y, ldy, M, K);
}

template <typename T>
cudaError_t launch_typed(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M, int N,
                         int K, int splits, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  const T* wt = static_cast<const T*>(w);
  T* yt = static_cast<T*>(y);
  if (M <= 16) return launch_tiled<T, 16>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, stream);
  if (M <= 32) return launch_tiled<T, 32>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, stream);
  if (M <= 64) return launch_tiled<T, 64>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, stream);
  return launch_tiled<T, 128>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, stream);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t launch_decode_gemm(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M,
                               int N, int K, int splits, ScalarType dtype, cudaStream_t stream) {
  if (M < 0 || M > kDecodeGemmMaxRows || N <= 0 || N % kDecodeGemmAlignN || K <= 0 || K % kDecodeGemmTileK ||
      splits < 1 || splits > kDecodeGemmMaxSplits || splits > K / kDecodeGemmTileK || ldx % 8 || ldw % 8 ||
      ldy % 4 || !aligned16(x) || !aligned16(w) || reinterpret_cast<uintptr_t>(y) % 8)
    return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  if (dtype == ScalarType::kBFloat16)
    return launch_typed<__nv_bfloat16>(x, ldx, w, ldw, y, ldy, M, N, K, splits, stream);
  if (dtype == ScalarType::kFloat16) return launch_typed<__half>(x, ldx, w, ldw, y, ldy, M, N, K, splits, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
