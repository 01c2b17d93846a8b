// Paged prefill attention on Hopper's warpgroup MMA (wgmma), sm_90a only. Opt-in: attention_ops.prefill_kernel
// never picks it; tests/test_prefill_kernels.py and scripts/prefill_bench.py run it (24/24 GPU tests at 27c2e6b,
// 282-342 TFLOP/s on the H200 against 279-304 for the default "wide" kernel).
//
// Same contract and per-warp arithmetic as paged_prefill.cu (each warp owns 16 query rows; the wgmma
// accumulator of a warpgroup's 64 rows lands in exactly the mma.sync m16n8 layout per warp, so the causal mask,
// the online softmax and the P -> A-fragment packing are unchanged). What differs:
// - A CTA is 2 warpgroups (256 threads) on 128 query rows with 128-key tiles, or 1 warpgroup on 64 rows with
//   64-key tiles and 2 CTAs per SM (Shape below; the kernel names "wgmma" and "wgmma1").
// - S = Q K^T is one wgmma.m64n128k16 per 16 of head dim with Q and K read straight from shared memory through
//   matrix descriptors; O += P V is one wgmma.m64nDk16 per 16 keys with P from registers and V (keys x D,
//   D contiguous) as an MN-major ("transposed") operand. No ldmatrix at all.
// - Tiles are stored in wgmma's canonical 128-byte-swizzle layout: column blocks of 64 elements, rows of 128
//   bytes, 16-byte chunk c of row r at chunk c ^ (r % 8), every tile on a 1024-byte boundary. cp.async writes
//   it (block-table gathers as in prefill_tiles.cuh); fence.proxy.async makes those writes visible to wgmma.
// - Descriptors: K-major (Q, K): SBO 1024 bytes between 8-row groups, LBO unused, a k16 step inside a column
//   block moves the start address by 32 bytes; MN-major (V): LBO = one column block (128 keys x 128 bytes),
//   SBO 1024 bytes between 8-key groups.
// Each wgmma batch is waited for at once (no overlap of softmax with the next GEMM inside a warpgroup yet); the
// two warpgroups of a 2-warpgroup CTA overlap each other only where their phases drift between its barriers.
#include <math_constants.h>

#include "attention.h"
#include "common.cuh"
#include "launch.h"
#include "prefill_tiles.cuh"

namespace minillm {
namespace {

// WG warpgroups of 64 query rows per CTA. 2: 128 rows, 128-key tiles, 1 CTA per SM (161 KB at D128); 1: 64 rows,
// 64-key tiles, 2 CTAs per SM (80 KB), whose warpgroups never wait at each other's barriers.
template <int WG>
struct Shape {
  static constexpr int kBM = 64 * WG, kBN = 64 * WG, kThreads = 128 * WG, kCtasPerSm = 3 - WG;
};

template <int D, int WG>
constexpr int smem_bytes() {  // Q + 2 stages of K and V + alignment
  return (Shape<WG>::kBM + 4 * Shape<WG>::kBN) * D * 2 + 1024;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A shared-memory matrix descriptor, 128-byte swizzle, SBO 1024 bytes; lbo in bytes (MN-major operands only).
__device__ __forceinline__ uint64_t gmma_desc(const void* p, uint32_t lbo) {
  const uint32_t a = smem_addr(p);
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// cp.async wrote the tile through the generic proxy; wgmma reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keep the compiler from touching registers a wgmma in flight reads or writes, until its wait.
template <int N>
__device__ __forceinline__ void hold(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
template <int N>
__device__ __forceinline__ void hold(uint32_t (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(d[i][e])::"memory");
}

// D(64 x N, fp32) (+)= A(64 x 16) B(16 x N): A and B K-major in shared memory; scale_d = 0 overwrites D.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, int scale_d);
// D(64 x N, fp32) += A(64 x 16, registers: the mma.sync A fragment of each warp's 16 rows) B, B MN-major in
// shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db);

template <>
__device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 64>(float (&d)[8][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31} "
      ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 128>(float (&d)[16][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
      "%59, %60, %61, %62, %63} "
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]),
        "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]),
        "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31} "
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
      "%59, %60, %61, %62, %63} "
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]),
        "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]),
        "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_ss<__half, 64>(float (&d)[8][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31} "
      ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_ss<__half, 128>(float (&d)[16][4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
      "%59, %60, %61, %62, %63} "
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]),
        "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]),
        "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs<__half, 64>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31} "
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<__half, 128>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
      "%59, %60, %61, %62, %63} "
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]),
        "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]),
        "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, int D, int WG>
__global__ void __launch_bounds__(Shape<WG>::kThreads, Shape<WG>::kCtasPerSm)
    paged_prefill_wgmma_kernel(PagedAttnArgs a, const int* __restrict__ qsl, int seq_begin) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  constexpr int kBM = Shape<WG>::kBM, kBN = Shape<WG>::kBN, kThreads = Shape<WG>::kThreads;
  constexpr int CH = D / 8, KS = D / 16, NT = kBN / 8, DT = D / 8;
  using TC = TileCopy<D, kThreads, kBN>;
  extern __shared__ uint4 smem_raw[];
  // The hardware swizzles by address bits: every tile starts on a 1024-byte boundary.
  T* sQ = reinterpret_cast<T*>(reinterpret_cast<char*>(smem_raw) + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T* sK = sQ + kBM * D;
  T* sV = sK + 2 * kBN * D;

  const int h = blockIdx.x, s = seq_begin + blockIdx.y;
  const int q0 = qsl[s], qlen = qsl[s + 1] - q0, ctx = a.seq_lens[s];
  const int m0 = (gridDim.z - 1 - blockIdx.z) * kBM;  // late (heavy, causal) tiles are scheduled first
  if (m0 >= qlen) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  const int kvh = h / (a.num_q_heads / a.num_kv_heads);
  const int pos0 = ctx - qlen;                     // position of query row 0
  const int n_end = min(ctx, pos0 + m0 + kBM);     // keys visible to the last row of this tile
  const int n_tiles = (n_end + kBN - 1) / kBN;
  const int64_t tok_stride = (int64_t)a.num_kv_heads * D;
  const int* bt = a.block_tables + s * a.bt_stride;
  const T* kc = static_cast<const T*>(a.k_cache) + kvh * D;
  const T* vc = static_cast<const T*>(a.v_cache) + kvh * D;

  load_q_tile<T, D, kBM, kThreads, true>(sQ, a, h, q0, m0, qlen);  // rows past qlen: zero-filled
  const int cr0 = threadIdx.x / CH, cc = threadIdx.x % CH;  // this thread's rows and column in tile copies
  const int bs_log2 = __ffs(a.block_size) - 1;
  int slot[TC::ROWS];
  tile_slots<D, kThreads, kBN>(slot, bt, bs_log2, 0, n_end, cr0);
  load_kv_tile<T, D, kThreads, kBN, true>(sK, kc, slot, tok_stride, cr0, cc);
  cp_async_commit();  // Q and K_0
  load_kv_tile<T, D, kThreads, kBN, true>(sV, vc, slot, tok_stride, cr0, cc);
  cp_async_commit();  // V_0
  if (n_tiles > 1) tile_slots<D, kThreads, kBN>(slot, bt, bs_log2, kBN, n_end, cr0);
  cp_async_wait<1>();
  fence_proxy_async();
  __syncthreads();

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
  const float sl2 = a.scale * kLog2e;
  const int wg_pos0 = pos0 + m0 + wg * 64;         // position of this warpgroup's first row
  const bool has_rows = m0 + wg * 64 < qlen;       // a warpgroup of padding rows only computes nothing
  const int warp_pos0 = pos0 + m0 + warp * 16;     // this warp's first row
  const int row_pos0 = warp_pos0 + lane / 4;       // this thread's first row
  const T* sQw = sQ + wg * 64 * 64;                // the warpgroup's 64 rows of every column block

  for (int j = 0; j < n_tiles; ++j) {
    const T* sKj = sK + (j & 1) * kBN * D;
    const T* sVj = sV + (j & 1) * kBN * D;
    if (j > 0) {
      cp_async_wait<1>();  // K_j landed (V_j may still be in flight)
      fence_proxy_async();
      __syncthreads();
    }
    // Every warpgroup finished (waited for) its wgmmas of tile j-1 before the barrier above.
    if (j + 1 < n_tiles)
      load_kv_tile<T, D, kThreads, kBN, true>(sK + ((j + 1) & 1) * kBN * D, kc, slot, tok_stride, cr0, cc);
    cp_async_commit();  // an empty group at the end keeps the wait counts uniform

    // Warpgroup-uniform (wgmma needs all 4 warps): skip a tile none of the warpgroup's rows sees.
    const bool visible = has_rows && j * kBN <= wg_pos0 + 63;
    float sc[NT][4];
    if (visible) {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {  // head dims 16ks..16ks+15: column block ks / 4, 32 bytes per k16 step
        wgmma_ss<T, kBN>(sc, gmma_desc(sQw + (ks / 4) * kBM * 64 + (ks % 4) * 16, 0),
                         gmma_desc(sKj + (ks / 4) * kBN * 64 + (ks % 4) * 16, 0), ks > 0);
      }
      wgmma_commit();
      wgmma_wait0();
      hold(sc);

      if (j * kBN + kBN - 1 > warp_pos0) {  // causal mask (and keys past the context), per warp
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j * kBN + nt * 8 + (lane % 4) * 2 + (e & 1);
            if (key > row_pos0 + (e >> 1) * 8) sc[nt][e] = -CUDART_INF_F;
          }
      }
      online_softmax_row<NT, DT, true>(sc, o, mrow[0], lrow[0], sl2, 0);
      online_softmax_row<NT, DT, true>(sc, o, mrow[1], lrow[1], sl2, 1);
    }

    cp_async_wait<1>();  // V_j landed (K_{j+1} may still be in flight)
    fence_proxy_async();
    __syncthreads();
    if (j + 1 < n_tiles)
      load_kv_tile<T, D, kThreads, kBN, true>(sV + ((j + 1) & 1) * kBN * D, vc, slot, tok_stride, cr0, cc);
    cp_async_commit();
    if (j + 2 < n_tiles) tile_slots<D, kThreads, kBN>(slot, bt, bs_log2, (j + 2) * kBN, n_end, cr0);

    if (visible) {
      uint32_t pa[kBN / 16][4];  // the S accumulator of two adjacent n-tiles is the A fragment of one k-step
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        pa[kk][0] = DType<T>::from_float2(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = DType<T>::from_float2(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = DType<T>::from_float2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = DType<T>::from_float2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)  // 16 keys = 2 groups of 8 rows of 128 bytes
        wgmma_rs<T, D>(o, pa[kk], gmma_desc(sVj + kk * 16 * 64, kBN * 128));
      wgmma_commit();
      wgmma_wait0();
      hold(o);
      hold(pa);
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = warp_sum_xor(lrow[r], 1, 4);
    const int row = m0 + warp * 16 + lane / 4 + r * 8;
    if (row >= qlen) continue;
    const float inv = 1.f / l;
    T* op = static_cast<T*>(a.out) + (int64_t)(q0 + row) * a.out_stride_t + h * a.out_stride_h + (lane % 4) * 2;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<uint32_t*>(op + i * 8) = DType<T>::from_float2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename T, int D, int WG>
cudaError_t launch_shape(const PagedAttnArgs& a, const int* qsl, int seq_begin, int max_query_len,
                         cudaStream_t stream) {
  constexpr int smem = smem_bytes<D, WG>();
  static const cudaError_t attr = cudaFuncSetAttribute(paged_prefill_wgmma_kernel<T, D, WG>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  const int q_tiles = (max_query_len + Shape<WG>::kBM - 1) / Shape<WG>::kBM;
  if (a.num_seqs > 65535 || q_tiles > 65535) return cudaErrorInvalidValue;  // grid y / z limits
  const dim3 grid(a.num_q_heads, a.num_seqs, q_tiles);
  return launch_kernel(paged_prefill_wgmma_kernel<T, D, WG>, grid, dim3(Shape<WG>::kThreads), smem, stream, a, qsl,
                       seq_begin);
}

template <typename T, int D>
cudaError_t launch_typed(const PagedAttnArgs& a, const int* qsl, int seq_begin, int max_query_len,
                         cudaStream_t stream, int warpgroups) {
  if (warpgroups == 2) return launch_shape<T, D, 2>(a, qsl, seq_begin, max_query_len, stream);
  if (warpgroups == 1) return launch_shape<T, D, 1>(a, qsl, seq_begin, max_query_len, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_paged_prefill_wgmma(const PagedAttnArgs& a, const int* query_start_loc, int seq_begin,
                                       int max_query_len, cudaStream_t stream, int warpgroups) {
  if (!prefill_args_valid(a, max_query_len)) return cudaErrorInvalidValue;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major != 9)
    return cudaErrorNotSupported;  // machine code for sm_90a only
  if (a.num_seqs == 0 || max_query_len == 0) return cudaSuccess;
  const bool bf16 = a.dtype == ScalarType::kBFloat16;
  if (a.head_dim == 128)
    return bf16 ? launch_typed<__nv_bfloat16, 128>(a, query_start_loc, seq_begin, max_query_len, stream, warpgroups)
                : launch_typed<__half, 128>(a, query_start_loc, seq_begin, max_query_len, stream, warpgroups);
  if (a.head_dim == 64)
    return bf16 ? launch_typed<__nv_bfloat16, 64>(a, query_start_loc, seq_begin, max_query_len, stream, warpgroups)
                : launch_typed<__half, 64>(a, query_start_loc, seq_begin, max_query_len, stream, warpgroups);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
