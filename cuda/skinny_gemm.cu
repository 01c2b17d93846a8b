// Skinny GEMM for decode-sized linear layers: y[M, N] = x[M, K] * w[N, K]^T with M <= a few hundred rows.
//
// Why: at decode batch sizes an output of M x N has few 128-wide tiles (o_proj and down_proj of Qwen3-0.6B:
// N = 1024, 8 tiles), so a library GEMM runs on a few dozen SMs, each streaming a long K, and takes 5.5-8 us for
// 4-12 MB of weights that HBM delivers in 1-3 us (cuBLAS on the H200; o_proj at M = 1: 12.6 us). Here the
// K dimension is split across the CTAs of a thread-block cluster (grid z = split = rank in the cluster): every
// CTA streams a K/splits slab of its 128 weight rows and of x through a 4-stage cp.async pipeline into swizzled
// shared memory, multiplies on mma.sync m16n8k16 with fp32 accumulators, leaves its partial tile in its shared
// memory, and after a cluster barrier each CTA sums a slice of rows over all ranks' tiles through distributed
// shared memory and writes them. No workspace, no second kernel, no atomics.
//
// CTA: 8 warps over an MT x 128 tile, MT in {16, 32, 64, 128} chosen from M (grid y covers M beyond 128), so a
// small batch does not pay for 128 padded rows. Rows of x past M are zero-filled, never read.
//
// Measured (scripts/gemm_sweep.py, results/gemm_sweep.jsonl): it beats cuBLAS only up to 16 rows on the narrow
// outputs (o_proj at M = 1: 4.9 vs 12.6 us); at M = 128 it takes 17.5 us for qkv (cuBLAS 5.5). ncu there: 7% of
// DRAM, 0.5 IPC, latency stalls throughout; load, math and the cluster reduction (whose barriers compile to a
// GPU-scope MEMBAR) run one after another with nothing to overlap them. minillm/ops/gemm_ops.py therefore routes
// only the small shapes here.
#include <cooperative_groups.h>

#include "common.cuh"
#include "gemm.h"
#include "launch.h"

namespace minillm {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kStages = 4;
[[maybe_unused]] constexpr int kChunks = kGemmTileK / 8;  // 16-byte chunks per row of a stage (8: 128-byte rows)
constexpr int kRedStride = kGemmTileN + 4;  // floats per row of the partial tile (rows 16-byte aligned)

template <int MT>
struct Tiling {
  static constexpr int WM = MT >= 128 ? 4 : (MT >= 32 ? 2 : 1);  // warps along M
  static constexpr int WN = 8 / WM;                               // warps along N
  static constexpr int WTM = MT / WM, WTN = kGemmTileN / WN;       // warp tile
  static constexpr int MF = WTM / 16, NF = WTN / 8;                // m16 and n8 fragments per warp
  static constexpr int STAGE = (MT + kGemmTileN) * kGemmTileK;     // elements per pipeline stage (A then B)
  static constexpr int PIPE_BYTES = kStages * STAGE * 2;
  static constexpr int RED_BYTES = MT * kRedStride * 4;
  static constexpr int SMEM = PIPE_BYTES > RED_BYTES ? PIPE_BYTES : RED_BYTES;
  static_assert(MF >= 1 && NF % 2 == 0, "warp tile must hold whole fragments");
};

// Copy k-tile kt of this CTA's slab: MT rows of x (zero past M) and 128 rows of w.
template <typename T, int MT>
__device__ __forceinline__ void load_stage(T* stage, const T* x, int64_t ldx, const T* w, int64_t ldw, int rows,
                                           int k) {
  T* sA = stage;
  T* sB = stage + MT * kGemmTileK;
  for (int i = threadIdx.x; i < MT * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < rows;
    cp_async16(sA + swz<kChunks>(r, c), valid ? x + r * ldx + k + c * 8 : x, valid ? 16 : 0);
  }
#pragma unroll
  for (int i = threadIdx.x; i < kGemmTileN * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    cp_async16(sB + swz<kChunks>(r, c), w + r * ldw + k + c * 8, 16);
  }
}

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads)
    skinny_gemm_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w, int64_t ldw, T* __restrict__ y,
                       int64_t ldy, int M, int K) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Tl = Tiling<MT>;
  extern __shared__ uint4 smem_raw[];
  T* pipe = reinterpret_cast<T*>(smem_raw);
  cg::cluster_group cluster = cg::this_cluster();
  const int splits = cluster.num_blocks(), rank = cluster.block_rank();
  const int n0 = blockIdx.x * kGemmTileN, m0 = blockIdx.y * MT;
  const int slab = K / splits, k0 = rank * slab, n_kt = slab / kGemmTileK;
  const int rows = min(MT, M - m0);
  const T* xb = x + m0 * ldx + k0;
  const T* wb = w + n0 * ldw + k0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / Tl::WN, wn = warp % Tl::WN;

  float acc[Tl::MF][Tl::NF][4];
#pragma unroll
  for (int i = 0; i < Tl::MF; ++i)
#pragma unroll
    for (int j = 0; j < Tl::NF; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_kt) load_stage<T, MT>(pipe + s * Tl::STAGE, xb, ldx, wb, ldw, rows, s * kGemmTileK);
    cp_async_commit();  // empty groups too: the wait count stays uniform
  }
  for (int kt = 0; kt < n_kt; ++kt) {
    cp_async_wait<kStages - 2>();  // k-tile kt landed (this thread's copies) ...
    __syncthreads();               // ... everyone's, and everyone is done with the stage refilled next
    const int nxt = kt + kStages - 1;
    if (nxt < n_kt) load_stage<T, MT>(pipe + (nxt % kStages) * Tl::STAGE, xb, ldx, wb, ldw, rows, nxt * kGemmTileK);
    cp_async_commit();

    const T* sA = pipe + (kt % kStages) * Tl::STAGE;
    const T* sB = sA + MT * kGemmTileK;
#pragma unroll
    for (int ks = 0; ks < kGemmTileK / 16; ++ks) {
      uint32_t af[Tl::MF][4];
#pragma unroll
      for (int mf = 0; mf < Tl::MF; ++mf)
        ldmatrix_x4(af[mf], sA + swz<kChunks>(wm * Tl::WTM + mf * 16 + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < Tl::NF / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, sB + swz<kChunks>(wn * Tl::WTN + np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                         2 * ks + ((lane >> 3) & 1)));
#pragma unroll
        for (int mf = 0; mf < Tl::MF; ++mf) {
          mma16816<T>(acc[mf][2 * np], af[mf], b[0], b[1]);
          mma16816<T>(acc[mf][2 * np + 1], af[mf], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become this CTA's partial tile

  float* red = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int mf = 0; mf < Tl::MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < Tl::NF; ++nf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * Tl::WTM + mf * 16 + lane / 4 + h * 8, c = wn * Tl::WTN + nf * 8 + (lane % 4) * 2;
        *reinterpret_cast<float2*>(red + r * kRedStride + c) = make_float2(acc[mf][nf][2 * h], acc[mf][nf][2 * h + 1]);
      }
  cluster.sync();  // every rank's partial tile is complete and visible to the cluster

  // Rank r sums rows [r * MT / splits, (r + 1) * MT / splits) over all ranks, 4 columns per thread and step. The
  // remote loads of all ranks are issued before any is summed: each is a round trip to another SM.
  const int per = MT / splits, r_begin = rank * per;
  constexpr int C4 = kGemmTileN / 4;
  for (int i = threadIdx.x; i < per * C4; i += kThreads) {
    const int r = r_begin + i / C4, c = (i % C4) * 4;
    if (r >= rows) continue;
    float4 part[kGemmMaxSplits];
#pragma unroll
    for (int q = 0; q < kGemmMaxSplits; ++q)
      if (q < splits) part[q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(red, q) + r * kRedStride + c);
    float4 sum = part[0];
#pragma unroll
    for (int q = 1; q < kGemmMaxSplits; ++q)
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
#endif
}

template <typename T, int MT>
cudaError_t launch_tiled(const T* x, int64_t ldx, const T* w, int64_t ldw, T* y, int64_t ldy, int M, int N, int K,
                         int splits, cudaStream_t stream) {
  constexpr int smem = Tiling<MT>::SMEM;
  const cudaError_t opt_in =
      cudaFuncSetAttribute(skinny_gemm_kernel<T, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (opt_in != cudaSuccess) return opt_in;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = splits;
  return launch_kernel_with(&cluster, 1, skinny_gemm_kernel<T, MT>, dim3(N / kGemmTileN, (M + MT - 1) / MT, splits),
                            dim3(kThreads), smem, stream, x, ldx, w, ldw, y, ldy, M, K);
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

}  // namespace

cudaError_t launch_skinny_gemm(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M,
                               int N, int K, int splits, ScalarType dtype, cudaStream_t stream) {
  const bool splits_ok = splits == 1 || splits == 2 || splits == 4 || splits == 8;
  if (M < 0 || N <= 0 || N % kGemmTileN || !splits_ok || K <= 0 || K % (splits * kGemmTileK) || ldx % 8 ||
      ldw % 8 || ldy % 4)
    return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  if (dtype == ScalarType::kBFloat16)
    return launch_typed<__nv_bfloat16>(x, ldx, w, ldw, y, ldy, M, N, K, splits, stream);
  if (dtype == ScalarType::kFloat16) return launch_typed<__half>(x, ldx, w, ldw, y, ldy, M, N, K, splits, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
