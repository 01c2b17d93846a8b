// Weight-read probe: how fast can a decode kernel read its weights from HBM, by load scheme?
//
// The MoE and decode GEMMs (cuda/moe_gemm.cu, cuda/decode_gemm.cu) load weights register-direct: lane (g, t)
// of a warp reads 16 bytes of rows g and g + 8 per k32 block, two register batches in flight (8 KB a warp,
// 128 KB an SM). They top out near 3 TB/s on long runs (Qwen3-30B-A3B gate_up at 64 tokens 3.25 TB/s, down
// 2.5; the dense decode GEMM on Qwen3-8B's gate_up 2.97 against cuBLAS's 3.99). This probe reads the same bytes
// four ways, with no math, to see whether the scheme or the access pattern is the limit:
//   frag     the GEMMs' pattern: items of 16 rows, a warp's 8 k32 blocks of both row halves in flight (frag8:
//            half of them at a time; frag_pf128 / frag_pf256: with the L2 prefetch-size hint of that many bytes)
//   coal     plain coalesced 16-byte loads (a warp reads 512 contiguous bytes per load), same bytes in flight
//   bulk     cp.async.bulk of contiguous chunks into a shared-memory ring (one thread issues, mbarriers), the
//            CTA's threads then read each chunk from shared memory once
//   bulkrow  the same with one copy per 4 KB weight row
//   coal_stage, bulk_frag: coalesced loads staged through shared memory, and bulk copies, each read back in the
//            fragment layout an mma kernel needs (the two ways to feed mma.sync from weights read at full rate)
// Usage (sm_90): nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/probe scripts/weight_read_probe.cu && /tmp/probe
// Prints one JSON line per (scheme, bytes): microseconds per read of `bytes` and TB/s, the median of 20 reads
// (each the mean of 10 back to back) rotating over buffers that together are 4x the L2.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

constexpr int kThreads = 256, kRowBytes = 4096, kItemRows = 16;  // gate_up at B = 1: 16 rows of 2048 bf16

__device__ __forceinline__ uint64_t evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 ldw(const void* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
// The same with an L2 prefetch-size hint: the L2 fetches the whole aligned 128 / 256 bytes around the address.
template <int kPrefetch>
__device__ __forceinline__ uint4 ldw_pf(const void* p, uint64_t pol) {
  if constexpr (kPrefetch == 0) return ldw(p, pol);
  uint4 v;
  if constexpr (kPrefetch == 128)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ uint32_t fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// frag: item i = 16 rows x 4 KB; warp w reads bytes [512 w, 512 w + 512) of every row: lane (g, t) 16 bytes of
// rows g and g + 8 at 64 b + 16 t for its 8 blocks b, all 16 loads in flight, then the next item.
// kN = 8: half of the item's blocks in flight at a time (64 KB an SM), to see whether bytes in flight matter.
template <int kN, int kPrefetch>
__global__ void __launch_bounds__(kThreads, 2) frag(const char* w, int items, uint32_t* sink) {
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  const uint64_t pol = evict_first();
  uint32_t acc = 0;
  for (int i = blockIdx.x; i < items; i += gridDim.x) {
    const char* base = w + (int64_t)i * kItemRows * kRowBytes + 512 * warp + 16 * t;
#pragma unroll
    for (int h = 0; h < 16 / kN; ++h) {
      uint4 r[kN];
#pragma unroll
      for (int b = 0; b < kN / 2; ++b) {
        const int blk = h * kN / 2 + b;
        r[2 * b] = ldw_pf<kPrefetch>(base + (int64_t)g * kRowBytes + 64 * blk, pol);
        r[2 * b + 1] = ldw_pf<kPrefetch>(base + (int64_t)(g + 8) * kRowBytes + 64 * blk, pol);
      }
#pragma unroll
      for (int j = 0; j < kN; ++j) acc ^= fold(r[j]);
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// coal: the same bytes per item, each warp 16 loads of 512 contiguous bytes.
__global__ void __launch_bounds__(kThreads, 2) coal(const char* w, int items, uint32_t* sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t pol = evict_first();
  uint32_t acc = 0;
  for (int i = blockIdx.x; i < items; i += gridDim.x) {
    const char* base = w + (int64_t)i * kItemRows * kRowBytes + warp * 8192 + 16 * lane;
    uint4 r[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) r[j] = ldw(base + 512 * j, pol);
#pragma unroll
    for (int j = 0; j < 16; ++j) acc ^= fold(r[j]);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// coal_stage: coal's loads, staged through the warp's own shared memory (16 rows x 512 B, rows padded by 16 B) and
// read back in frag's fragment layout, as an mma kernel with coalesced weight loads would: the next item's loads
// are issued once this item's registers are in shared memory.
constexpr int kStageRow = 512 + 16;
__global__ void __launch_bounds__(kThreads, 2) coal_stage(const char* w, int items, uint32_t* sink) {
  extern __shared__ __align__(16) char stage[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  char* mine = stage + warp * kItemRows * kStageRow;
  const uint64_t pol = evict_first();
  uint32_t acc = 0;
  uint4 r[16];
  const auto load = [&](int i) {
    const char* base = w + (int64_t)i * kItemRows * kRowBytes + 512 * warp + 16 * lane;
#pragma unroll
    for (int j = 0; j < 16; ++j) r[j] = ldw(base + (int64_t)j * kRowBytes, pol);   // row j, 512 contiguous B
  };
  if (blockIdx.x < items) load(blockIdx.x);
  for (int i = blockIdx.x; i < items; i += gridDim.x) {
#pragma unroll
    for (int j = 0; j < 16; ++j) *reinterpret_cast<uint4*>(mine + j * kStageRow + 16 * lane) = r[j];
    __syncwarp();
    if (i + gridDim.x < items) load(i + gridDim.x);
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      acc ^= fold(*reinterpret_cast<const uint4*>(mine + g * kStageRow + 64 * b + 16 * t));
      acc ^= fold(*reinterpret_cast<const uint4*>(mine + (g + 8) * kStageRow + 64 * b + 16 * t));
    }
    __syncwarp();
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// bulk: a ring of kStages chunks of `chunk` bytes (one item = 64 KB = 64 KB / chunk chunks); thread 0 keeps the
// ring full, every thread reads its 16-byte words of each chunk from shared memory.
// kFragRead: each warp reads the chunk (one item, 16 rows x 4 KB) in frag's fragment layout instead of linearly:
// the bank-conflicted pattern (rows 4 KB apart) an mma kernel on bulk-copied weights would read.
template <int kStages, bool kFragRead = false>
__global__ void __launch_bounds__(kThreads, 1) bulk(const char* w, int items, int chunk, uint32_t* sink) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kStages];
  const int per_item = kItemRows * kRowBytes / chunk;
  const int64_t n = (int64_t)((items - blockIdx.x + gridDim.x - 1) / gridDim.x) * per_item;  // chunks of this CTA
  const auto src = [&](int64_t c) {
    const int64_t item = blockIdx.x + (c / per_item) * gridDim.x;
    return w + item * kItemRows * kRowBytes + (c % per_item) * chunk;
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&full[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const auto issue = [&](int64_t c) {
    const int s = c % kStages;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&full[s])), "r"(chunk)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     saddr(ring + s * chunk)),
                 "l"(src(c)), "r"(chunk), "r"(saddr(&full[s]))
                 : "memory");
  };
  if (threadIdx.x == 0)
    for (int64_t c = 0; c < kStages && c < n; ++c) issue(c);
  uint32_t acc = 0;
  for (int64_t c = 0; c < n; ++c) {
    const int s = c % kStages;
    const uint32_t parity = (c / kStages) & 1;
    uint32_t ok = 0;
    while (!ok)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(ok)
                   : "r"(saddr(&full[s])), "r"(parity)
                   : "memory");
    const char* v = ring + s * chunk;
    if constexpr (kFragRead) {
      const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        acc ^= fold(*reinterpret_cast<const uint4*>(v + g * kRowBytes + 512 * warp + 64 * b + 16 * t));
        acc ^= fold(*reinterpret_cast<const uint4*>(v + (g + 8) * kRowBytes + 512 * warp + 64 * b + 16 * t));
      }
    } else {
      for (int j = threadIdx.x; j < chunk / 16; j += kThreads) acc ^= fold(reinterpret_cast<const uint4*>(v)[j]);
    }
    __syncthreads();  // the stage is read: refill it
    if (threadIdx.x == 0 && c + kStages < n) issue(c + kStages);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

template <int kStages, bool kFragRead = false>
cudaError_t launch_bulk(int grid, size_t smem, const char* w, int items, int chunk, uint32_t* sink) {
  cudaFuncSetAttribute(bulk<kStages, kFragRead>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  bulk<kStages, kFragRead><<<grid, kThreads, smem>>>(w, items, chunk, sink);
  return cudaGetLastError();
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const int64_t item_bytes = int64_t(kItemRows) * kRowBytes;
  uint32_t* sink;
  CHECK(cudaMalloc(&sink, 4));
  const int64_t sizes[] = {50331648, 402653184};  // 8 experts' gate_up (B = 1), 64 experts'
  for (int64_t bytes : sizes) {
    const int items = int(bytes / item_bytes);
    const int nbuf = int(std::max<int64_t>(2, 4 * int64_t(l2) / bytes + 1));
    char* buf;
    CHECK(cudaMalloc(&buf, bytes * nbuf));
    CHECK(cudaMemset(buf, 1, bytes * nbuf));
    enum Kind { kFrag, kFrag8, kFragPf128, kFragPf256, kCoal, kCoalStage, kBulk, kBulkFrag };
    struct Scheme {
      const char* name;
      Kind kind;
      int chunk, stages;
    };
    const Scheme schemes[] = {{"frag", kFrag, 0, 0},          {"frag8", kFrag8, 0, 0},
                              {"frag_pf128", kFragPf128, 0, 0}, {"frag_pf256", kFragPf256, 0, 0},
                              {"coal", kCoal, 0, 0},          {"coal_stage", kCoalStage, 0, 0},
                              {"bulk", kBulk, 32768, 3},      {"bulk", kBulk, 16384, 6},
                              {"bulk", kBulk, 65536, 3},      {"bulk_frag", kBulkFrag, 65536, 3},
                              {"bulkrow", kBulk, 4096, 24}};
    for (const Scheme& sc : schemes) {
      const auto launch = [&](const char* w) -> cudaError_t {
        const int grid2 = std::min(items, 2 * sms), grid1 = std::min(items, sms);
        const size_t ring = size_t(sc.chunk) * sc.stages, staged = size_t(8) * kItemRows * kStageRow;
        switch (sc.kind) {
          case kFrag: frag<16, 0><<<grid2, kThreads>>>(w, items, sink); break;
          case kFrag8: frag<8, 0><<<grid2, kThreads>>>(w, items, sink); break;
          case kFragPf128: frag<16, 128><<<grid2, kThreads>>>(w, items, sink); break;
          case kFragPf256: frag<16, 256><<<grid2, kThreads>>>(w, items, sink); break;
          case kCoal: coal<<<grid2, kThreads>>>(w, items, sink); break;
          case kCoalStage:
            cudaFuncSetAttribute(coal_stage, cudaFuncAttributeMaxDynamicSharedMemorySize, int(staged));
            coal_stage<<<grid2, kThreads, staged>>>(w, items, sink);
            break;
          case kBulkFrag: return launch_bulk<3, true>(grid1, ring, w, items, sc.chunk, sink);
          case kBulk:
            return sc.stages == 3   ? launch_bulk<3>(grid1, ring, w, items, sc.chunk, sink)
                   : sc.stages == 6 ? launch_bulk<6>(grid1, ring, w, items, sc.chunk, sink)
                                    : launch_bulk<24>(grid1, ring, w, items, sc.chunk, sink);
        }
        return cudaGetLastError();
      };
      for (int r = 0; r < 3; ++r) CHECK(launch(buf + (r % nbuf) * bytes));  // warm-up
      CHECK(cudaDeviceSynchronize());
      std::vector<float> us;
      cudaEvent_t a, b;
      CHECK(cudaEventCreate(&a));
      CHECK(cudaEventCreate(&b));
      for (int r = 0; r < 20; ++r) {  // 10 reads back to back a sample: the launch gaps overlap the reads
        CHECK(cudaEventRecord(a));
        for (int j = 0; j < 10; ++j) CHECK(launch(buf + ((10 * r + j) % nbuf) * bytes));
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        us.push_back(ms * 100);
      }
      std::sort(us.begin(), us.end());
      const float med = us[us.size() / 2];
      printf("{\"probe\": \"weight_read\", \"scheme\": \"%s\", \"chunk\": %d, \"stages\": %d, \"bytes\": %lld, "
             "\"us\": %.2f, \"min_us\": %.2f, \"tb_s\": %.3f}\n",
             sc.name, sc.chunk, sc.stages, (long long)bytes, med, us[0], bytes / (med * 1e-6) / 1e12);
    }
    CHECK(cudaFree(buf));
  }
  return 0;
}
