// Decode GEMM: y[M, N] = x[M, K] * w[N, K]^T for decode batches (M <= 64) on Hopper, weight-streaming.
//
// Why: at decode sizes the product is a weight read (Qwen3-0.6B: 4-12 MB per GEMM, 1-3 us of HBM) with a little
// math on the side. cuBLAS spends 5-8 us per call there and takes no part in programmatic dependent launch, so no
// weight byte moves before the kernel in front of it has ended. The weights are constants, so this kernel starts
// loading them before `griddepcontrol.wait`; only the activations x (the previous kernel's output) wait.
//
// Register-direct: weights go from global memory straight into mma.sync A fragments, never through shared memory.
// The dot product over K does not care about the order of K, so any permutation of K used consistently by the A
// (weight) and B (x) fragments gives the same sum. Lane (g, t) of a warp (g = lane / 4, t = lane % 4) loads 16
// contiguous bytes at columns c + 8t of weight rows g and g + 8 (wa, wb) and of x row g (xa); one such k32 block
// is two m16n8k16 mmas: A = {wa.x, wb.x, wa.y, wb.y}, B = {xa.x, xa.y}, then the .z/.w halves. Every 16-byte load
// is a full-width LDG by every lane; a warp's loads of a k32 block are 8 rows x 64 contiguous bytes.
//
// Work: a warp owns 16 weight rows and a contiguous range of k32 blocks; a CTA is 8 warps, RW (row warps, 1/2/4/8)
// x KW (= 8 / RW) warps along K, over BN = 16 RW weight rows; grid z is a split of K over the CTAs of one cluster
// (S = 1..8). The caller picks (S, RW) so that the grid fills the GPU in one wave (minillm/ops/decode_gemm.py).
// x rows past M are loaded as row M - 1 (in bounds); they only feed output columns that are never stored.
//
// Streaming: each warp keeps two batches of U k32 blocks in flight in registers (loads of batch i + 2 issued as
// soon as batch i's mmas have read their registers): 4-8 KB per warp, 64-128 KB per SM (batch_blocks below).
// Weight loads skip L1 and are marked evict-first in L2 (read once per step); x loads go through L1, where the RW
// warps that share a K range hit. The first two batches are issued before griddepcontrol.wait.
//
// Reduction, no workspace and no second kernel: each warp's fp32 16 x 8NT tile goes to shared memory as
// [kw][m][n]; the CTA sums its KW slices in place; with S > 1 a cluster barrier, then rank r sums its share of
// the cluster's (m, 4 columns) items over the S ranks with ld.shared::cluster (explicit DSMEM loads, issued
// together), writes y, and a second cluster barrier keeps the tiles alive until every rank has read them.
#include <cooperative_groups.h>

#include "common.cuh"
#include "decode_gemm.h"
#include "launch.h"
#include "weight_stream.cuh"

namespace minillm {
namespace {

namespace cg = cooperative_groups;

[[maybe_unused]] constexpr int kWarps = 8, kThreads = 32 * kWarps;
[[maybe_unused]] constexpr int kBlockK = kDecodeGemmTileK;  // 32 columns per k32 block

// k32 blocks per register batch (2 x U x 8 weight registers) and CTAs per SM: NT <= 4 fits U x 2 x 8 weight
// registers beside NT x 8 of x and acc in 128 registers (two CTAs per SM); NT = 8 would be left one block per
// batch there (32 KB per SM in flight), so it takes one CTA per SM with U = 4 (186 registers, 64 KB in flight).
// ptxas -v, sm_90a: no spills.
[[maybe_unused]] constexpr int batch_blocks(int nt) { return nt >= 8 ? 4 : nt >= 4 ? 2 : 4; }
[[maybe_unused]] constexpr int ctas_per_sm(int nt) { return nt >= 8 ? 1 : 2; }

template <int NT>
struct Cfg {
  static constexpr int MT = 8 * NT;           // x rows per tile (mma n side)
  // Shared memory of the partial tiles: KW x MT x (BN + 4) floats with KW * BN = 128 (+4: conflict-free stores).
  static constexpr int smem_bytes(int rw) { return (kWarps / rw) * MT * (16 * rw + 4) * 4; }
};

[[maybe_unused]] __device__ __forceinline__ float4 ld_cluster_f4(const float* local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

template <typename T>
struct Warp {
  const T* w0;  // weight row g of this warp's 16, column 8t of its first k32 block
  const T* w1;  // row g + 8
  int n_kb;     // k32 blocks of this warp
};

// Batch `b` (U k32 blocks from block b * U) of the warp's weights; blocks past the range are zeros.
template <typename T, int U>
__device__ __forceinline__ void load_batch(uint4 (&r)[U][2], const Warp<T>& wp, int b, uint64_t pol) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kb = b * U + u;
    if (kb < wp.n_kb) {
      r[u][0] = ld_weight(wp.w0 + kb * kBlockK, pol);
      r[u][1] = ld_weight(wp.w1 + kb * kBlockK, pol);
    } else {
      r[u][0] = r[u][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// acc += batch b: x for each block is loaded (NT x 16 bytes per lane) right before its mmas.
template <typename T, int NT, int U>
__device__ __forceinline__ void compute_batch(float (&acc)[NT][4], const uint4 (&r)[U][2], const T* xc,
                                              const int (&xoff)[NT], int b, int n_kb) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kb = b * U + u;
    if (kb >= n_kb) break;
    uint4 xv[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) xv[j] = ld_x(xc + xoff[j] + kb * kBlockK);
    const uint32_t a0[4] = {r[u][0].x, r[u][1].x, r[u][0].y, r[u][1].y};
    const uint32_t a1[4] = {r[u][0].z, r[u][1].z, r[u][0].w, r[u][1].w};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      mma16816<T>(acc[j], a0, xv[j].x, xv[j].y);
      mma16816<T>(acc[j], a1, xv[j].z, xv[j].w);
    }
  }
}

template <typename T, int NT>
__global__ void __launch_bounds__(kThreads, ctas_per_sm(NT))
    decode_gemm_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ w, int64_t ldw,
                       T* __restrict__ y, int64_t ldy, int M, int K, int rw) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = Cfg<NT>;
  constexpr int U = batch_blocks(NT);
  extern __shared__ __align__(16) float red[];
  const int kw_n = kWarps / rw, bn = 16 * rw, stride = bn + 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wr = warp % rw, wk = warp / rw;
  const int splits = gridDim.z, rank = blockIdx.z;
  // This warp's part of K: part rank * KW + wk of splits * KW contiguous k32-block ranges.
  const int parts = splits * kw_n, part = rank * kw_n + wk, total_kb = K / kBlockK;
  const int kb0 = part * total_kb / parts, kb1 = (part + 1) * total_kb / parts;
  const int n0 = blockIdx.x * bn + wr * 16;
  const T* wcol = w + kb0 * kBlockK + 8 * t;
  const Warp<T> wp{wcol + (n0 + g) * ldw, wcol + (n0 + g + 8) * ldw, kb1 - kb0};
  const int n_batches = (wp.n_kb + U - 1) / U;
  const uint64_t pol = evict_first_policy();

  // Weights first: constants, so they may stream while the kernel before this one is still running.
  uint4 ra[U][2], rb[U][2];
  load_batch<T, U>(ra, wp, 0, pol);
  load_batch<T, U>(rb, wp, 1, pol);
  pdl_wait();     // x is the previous kernel's output; y may be memory it still reads
  pdl_trigger();  // the next kernel may be scheduled (it waits for this grid's end in its own pdl_wait)

  const T* xc = x + kb0 * kBlockK + 8 * t;  // x row offsets kept 32-bit: the registers go to the weights
  int xoff[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xoff[j] = min(8 * j + g, M - 1) * static_cast<int>(ldx);
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int b = 0; b < n_batches; b += 2) {
    compute_batch<T, NT, U>(acc, ra, xc, xoff, b, wp.n_kb);
    if (b + 2 < n_batches) load_batch<T, U>(ra, wp, b + 2, pol);
    if (b + 1 < n_batches) compute_batch<T, NT, U>(acc, rb, xc, xoff, b + 1, wp.n_kb);
    if (b + 3 < n_batches) load_batch<T, U>(rb, wp, b + 3, pol);
  }

  // Partial tile [kw][m][n]: d0/d1 are weight row g, x rows 2t / 2t + 1 of n-tile j; d2/d3 weight row g + 8.
  float* mine = red + wk * C::MT * stride;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      mine[(8 * j + 2 * t + (e & 1)) * stride + wr * 16 + g + 8 * (e >> 1)] = acc[j][e];
  __syncthreads();

  // The CTA's KW slices summed into slice 0 (rows past M are never read again).
  const int c4 = bn / 4, items = M * c4;
  if (kw_n > 1) {
    for (int i = threadIdx.x; i < items; i += kThreads) {
      float* p = red + (i / c4) * stride + (i % c4) * 4;
      float4 s = *reinterpret_cast<float4*>(p);
      for (int q = 1; q < kw_n; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(p + q * C::MT * stride);
        s.x += v.x;
        s.y += v.y;
        s.z += v.z;
        s.w += v.w;
      }
      *reinterpret_cast<float4*>(p) = s;
    }
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1)
    cluster.sync();  // every rank's summed tile is complete and visible to the cluster
  else
    __syncthreads();

  // Rank r writes items [r * items / S, (r + 1) * items / S), each summed over the S ranks' tiles.
  const int i_begin = rank * items / splits, i_end = (rank + 1) * items / splits;
  for (int i = i_begin + threadIdx.x; i < i_end; i += kThreads) {
    const int m = i / c4, c = (i % c4) * 4;
    const float* p = red + m * stride + c;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q0 = 0; q0 < splits; q0 += 4) {  // 4 remote loads in flight at a time (8 would spill)
      float4 v[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (q0 + q < splits) v[q] = splits > 1 ? ld_cluster_f4(p, q0 + q) : *reinterpret_cast<const float4*>(p);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (q0 + q < splits) {
          s.x += v[q].x;
          s.y += v[q].y;
          s.z += v[q].z;
          s.w += v[q].w;
        }
    }
    uint2 out;
    out.x = DType<T>::from_float2(s.x, s.y);
    out.y = DType<T>::from_float2(s.z, s.w);
    *reinterpret_cast<uint2*>(y + m * ldy + blockIdx.x * bn + c) = out;
  }
  if (splits > 1) cluster.sync();  // keep this CTA's tile alive until every rank has read it
#else
  pdl_enter();  // never launched below sm_90 (the launcher refuses), but keep the PDL contract
#endif
}

template <typename T, int NT>
cudaError_t launch_nt(const T* x, int64_t ldx, const T* w, int64_t ldw, T* y, int64_t ldy, int M, int N, int K,
                      int splits, int rw, cudaStream_t stream) {
  const int smem = Cfg<NT>::smem_bytes(rw);  // at most 40 KB: no opt-in needed
  const dim3 grid(N / (16 * rw), 1, splits);
  if (splits == 1)
    return launch_kernel(decode_gemm_kernel<T, NT>, grid, dim3(kThreads), smem, stream, x, ldx, w, ldw, y, ldy, M,
                         K, rw);
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = splits;
  return launch_kernel_with(&cluster, 1, decode_gemm_kernel<T, NT>, grid, dim3(kThreads), smem, stream, x, ldx, w,
                            ldw, y, ldy, M, K, rw);
}

template <typename T>
cudaError_t launch_typed(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M, int N,
                         int K, int splits, int rw, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  const T* wt = static_cast<const T*>(w);
  T* yt = static_cast<T*>(y);
  if (M <= 8) return launch_nt<T, 1>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, rw, stream);
  if (M <= 16) return launch_nt<T, 2>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, rw, stream);
  if (M <= 32) return launch_nt<T, 4>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, rw, stream);
  return launch_nt<T, 8>(xt, ldx, wt, ldw, yt, ldy, M, N, K, splits, rw, stream);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool decode_gemm_config_ok(int K, int splits, int row_warps) {
  const bool rw_ok = row_warps == 1 || row_warps == 2 || row_warps == 4 || row_warps == 8;
  return rw_ok && splits >= 1 && splits <= kDecodeGemmMaxSplits &&
         splits * (kDecodeGemmWarps / row_warps) <= K / kDecodeGemmTileK;
}

cudaError_t launch_decode_gemm(const void* x, int64_t ldx, const void* w, int64_t ldw, void* y, int64_t ldy, int M,
                               int N, int K, int splits, int row_warps, ScalarType dtype, cudaStream_t stream) {
  if (M < 0 || M > kDecodeGemmMaxRows || N <= 0 || N % kDecodeGemmAlignN || K <= 0 || K % kDecodeGemmTileK ||
      !decode_gemm_config_ok(K, splits, row_warps) || ldx % 8 || ldw % 8 || ldy % 4 || !aligned16(x) ||
      !aligned16(w) || reinterpret_cast<uintptr_t>(y) % 8)
    return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  if (dtype == ScalarType::kBFloat16)
    return launch_typed<__nv_bfloat16>(x, ldx, w, ldw, y, ldy, M, N, K, splits, row_warps, stream);
  if (dtype == ScalarType::kFloat16)
    return launch_typed<__half>(x, ldx, w, ldw, y, ldy, M, N, K, splits, row_warps, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
