// Truncation threshold per row for top-k / top-p / min-p without sorting. Its reference, the torch path
// (minillm/ops/sampling_ops.py: truncation_threshold_torch), sorts the whole row.
//
// Semantics, on the descending order s[0..V-1] of a row and its softmax: keep the first min(k, kept_p)
// positions, where position i is kept by top-p when the mass strictly before it is < p * (top-k mass),
// at least one kept; the threshold is the value at the last kept position (every tie of it is kept: the caller
// masks `logit < threshold`), -inf when all V are kept; then max(threshold, max + log(min_p)).
// In values rather than positions: the top-k threshold is the k-th largest value; the top-p threshold is the
// smallest value v with mass(values > v) < p * M (the first position of v's tie group is then kept, and every
// position of a smaller value is not); the threshold is the larger of the two.
//
// Radix select over an order-preserving 32-bit key of each fp32 logit (-0 counted as +0), in three levels of
// 11, 11 and 10 bits. Each level reads the row, and for the logits whose key matches the prefix chosen so far
// builds a histogram of the next digit: a count and a probability mass per bucket. A block scan over the
// buckets from the top then picks the bucket that holds the k-th value (counts) or the top-p value (masses) and
// narrows the prefix. Masses are exp(logit - max) in fixed point (2^40 per unit, 64-bit integer atomics): sums
// are exact and independent of the order the atomics land in, so a row's threshold is the same on every run.
// (Each mass is rounded to 2^-41 of the max's: over a 152k vocab, less than 1e-7 of the total.)
// Passes over a row: one for the max when top-p or min-p is on, three for top-k, three for top-p (restricted to
// logits at or above the k-th value when both are on, since a smaller top-p threshold loses to it).
// Shared-memory atomics: each thread keeps a run of equal buckets in registers and adds it at once when the
// bucket changes, so a peaked row (most logits in one bucket) does not serialise on one address.
// One CTA per row when the rows fill the GPU. With few rows (decode batches of 1-16 against 132 SMs) one CTA
// would stream its whole row alone, so on sm_90 a cluster of up to 8 CTAs shares each row, one slice each: every
// CTA builds the histogram of its slice, then reads all the cluster's histograms (distributed shared memory) and
// makes the same pick from their sum (integers: the same in every CTA, and the same threshold as one CTA).
// Compile-only check: nvcc -c -gencode arch=compute_90a,code=sm_90a cuda/sampling_topp.cu
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include <cooperative_groups.h>

#include "fused.h"
#include "launch.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MINILLM_TOPP_CLUSTERS 1  // thread block clusters and distributed shared memory
#else
#define MINILLM_TOPP_CLUSTERS 0
#endif

namespace minillm {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBuckets = 2048;  // the largest digit: 11 bits
constexpr int kPerThread = kBuckets / kThreads;
constexpr int kLevels = 3;
constexpr float kMassScale = 1099511627776.f;  // 2^40

__device__ __forceinline__ int level_shift(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__device__ __forceinline__ int level_buckets(int level) { return level < 2 ? 2048 : 1024; }

// Larger float, larger key (-0 is folded into +0 first, so equal values have equal keys).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x + 0.f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ unsigned long long fixed_mass(float x, float mx) {
  return __float2ull_rn(expf(x - mx) * kMassScale);
}

struct Hist {
  unsigned int count[kBuckets];
  unsigned long long mass[kBuckets];
};

// The bucket a level picked, and what lies above it among the logits of the prefix.
struct Pick {
  int bucket;
  unsigned int count_above, count_in;
  unsigned long long mass_above;
};

struct Scratch {
  Hist hist;
  unsigned int warp_count[kWarps];
  unsigned long long warp_mass[kWarps];
  unsigned long long total;
  int lowest, fallback;  // scan indices (descending bucket order) of the candidates
  Pick pick[kLevels];    // one per level: a level's result is read while the next is being set up
  float max[kWarps];
  float row_max;         // this CTA's max, read by the row's other CTAs
};

// The CTAs of one row: `splits` CTAs of a cluster (sm_90), each on a slice of the row, which read each other's
// histograms through distributed shared memory; or one CTA (splits == 1). Every CTA of a row takes the same
// branches (they depend only on the row's parameters and on the merged histograms), so their barriers match.
struct RowGroup {
  int splits, rank;

  // A barrier of every thread of the row's CTAs (memory of each visible to all).
  __device__ void sync() const {
#if MINILLM_TOPP_CLUSTERS
    if (splits > 1) {
      cooperative_groups::this_cluster().sync();
      return;
    }
#endif
    __syncthreads();
  }

  // `local` (this CTA's shared memory) as it lies in CTA r of the row.
  template <typename T>
  __device__ T* at(T* local, int r) const {
#if MINILLM_TOPP_CLUSTERS
    if (splits > 1) return cooperative_groups::this_cluster().map_shared_rank(local, r);
#endif
    return local;
  }
};

__device__ __forceinline__ void flush(Hist& h, int b, unsigned int c, unsigned long long m, bool mass) {
  if (c == 0) return;
  atomicAdd(&h.count[b], c);
  if (mass) atomicAdd(&h.mass[b], m);
}

// f(logit) for each logit of the row, this thread's share. One CTA streams a whole row (from L2 or HBM), so each
// thread keeps kUnroll 16-byte loads in flight before it uses them: one load at a time leaves the SM waiting on
// latency. Scalar loads (a row off the 16-byte grid) take the plain loop.
constexpr int kUnroll = 4;

template <bool VEC, typename F>
__device__ __forceinline__ void for_each_logit(const float* __restrict__ x, int vocab, F&& f) {
  if constexpr (VEC) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int n4 = vocab / 4, step = static_cast<int>(blockDim.x);
    int i = threadIdx.x;
    for (; i + (kUnroll - 1) * step < n4; i += kUnroll * step) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = x4[i + u * step];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        f(v[u].x);
        f(v[u].y);
        f(v[u].z);
        f(v[u].w);
      }
    }
    for (; i < n4; i += step) {
      const float4 v = x4[i];
      f(v.x);
      f(v.y);
      f(v.z);
      f(v.w);
    }
  } else {
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) f(x[i]);
  }
}

// Histogram of digit (key >> shift) & digit_mask over this CTA's logits (x, vocab: its slice) with
// (key & prefix_mask) == prefix and key >= floor_key. Ends with the histograms of all the row's CTAs complete.
template <bool VEC>
__device__ void histogram_pass(const float* x, int vocab, uint32_t prefix, uint32_t prefix_mask, int shift,
                               uint32_t digit_mask, uint32_t floor_key, bool mass, float mx, Scratch& s,
                               const RowGroup& g) {
  g.sync();  // no CTA of the row still reads the previous histograms
  for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) {
    s.hist.count[b] = 0;
    s.hist.mass[b] = 0;
  }
  __syncthreads();
  int run_b = -1;
  unsigned int run_c = 0;
  unsigned long long run_m = 0;
  auto add = [&](float v) {
    const uint32_t key = order_key(v);
    if ((key & prefix_mask) != prefix || key < floor_key) return;
    const int b = static_cast<int>((key >> shift) & digit_mask);
    const unsigned long long m = mass ? fixed_mass(v, mx) : 0ull;
    if (b != run_b) {
      flush(s.hist, run_b, run_c, run_m, mass);
      run_b = b;
      run_c = 0;
      run_m = 0;
    }
    ++run_c;
    run_m += m;
  };
  for_each_logit<VEC>(x, vocab, add);
  flush(s.hist, run_b, run_c, run_m, mass);
  g.sync();  // every CTA's histogram of the row is complete
}

// Inclusive prefix sums of a count and a mass over the lanes of a warp.
__device__ __forceinline__ void warp_inclusive_scan(unsigned int& c, unsigned long long& m) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned int uc = __shfl_up_sync(0xffffffffu, c, o);
    const unsigned long long um = __shfl_up_sync(0xffffffffu, m, o);
    if (lane >= o) {
      c += uc;
      m += um;
    }
  }
}

// Exclusive scan of the row's buckets (the sum of its CTAs' histograms) in descending order (scan index i = bucket
// nb - 1 - i): for each of this thread's kPerThread indices, the count and mass of the buckets above it. Also sets
// s.total. Every CTA of the row computes the same integers.
__device__ void scan_buckets(Scratch& s, const RowGroup& g, int nb, unsigned int (&cnt)[kPerThread],
                             unsigned long long (&ms)[kPerThread], unsigned int (&ex_c)[kPerThread],
                             unsigned long long (&ex_m)[kPerThread]) {
  unsigned int c = 0;
  unsigned long long m = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int b = nb - 1 - (static_cast<int>(threadIdx.x) * kPerThread + j);
    cnt[j] = 0;
    ms[j] = 0;
    for (int r = 0; r < g.splits && b >= 0; ++r) {
      const Hist* h = g.at(&s.hist, r);
      cnt[j] += h->count[b];
      ms[j] += h->mass[b];
    }
    ex_c[j] = c;
    ex_m[j] = m;
    c += cnt[j];
    m += ms[j];
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  unsigned int ic = c;
  unsigned long long im = m;
  warp_inclusive_scan(ic, im);
  if (lane == 31) {
    s.warp_count[warp] = ic;
    s.warp_mass[warp] = im;
  }
  __syncthreads();
  if (warp == 0) {
    unsigned int wc = lane < kWarps ? s.warp_count[lane] : 0;
    unsigned long long wm = lane < kWarps ? s.warp_mass[lane] : 0;
    warp_inclusive_scan(wc, wm);
    if (lane < kWarps) {  // exclusive per warp
      s.warp_count[lane] = wc - (lane < kWarps ? s.warp_count[lane] : 0);
      s.warp_mass[lane] = wm - (lane < kWarps ? s.warp_mass[lane] : 0);
    }
    if (lane == kWarps - 1) s.total = wm;
    if (lane == 0) {
      s.lowest = -1;
      s.fallback = INT32_MAX;
    }
  }
  __syncthreads();
  const unsigned int base_c = s.warp_count[warp] + ic - c;
  const unsigned long long base_m = s.warp_mass[warp] + im - m;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    ex_c[j] += base_c;
    ex_m[j] += base_m;
  }
}

// Radix select over the logits at or above floor_key. By count: the key of the rank-th largest (rank >= 1).
// By mass: the smallest key whose logits have mass(keys above) < target, where target < 0 means p * (their
// total mass) (p-only rows), else the given target in 2^-40 units; the top key when none qualifies. Sets `key`,
// the count and mass of the logits above it and the count of those equal to it.
template <bool VEC>
__device__ void radix_select(const float* x, int vocab, float mx, bool by_mass, bool want_mass, unsigned int rank,
                             float p, double target, uint32_t floor_key, Scratch& s, const RowGroup& g, uint32_t& key,
                             unsigned int& count_above, unsigned int& count_eq, unsigned long long& mass_above) {
  uint32_t prefix = 0, prefix_mask = 0;
  count_above = 0;
  mass_above = 0;
  for (int level = 0; level < kLevels; ++level) {
    const int shift = level_shift(level), nb = level_buckets(level);
    histogram_pass<VEC>(x, vocab, prefix, prefix_mask, shift, static_cast<uint32_t>(nb - 1), floor_key,
                        want_mass || by_mass, mx, s, g);
    unsigned int cnt[kPerThread], ex_c[kPerThread];
    unsigned long long ms[kPerThread], ex_m[kPerThread];
    scan_buckets(s, g, nb, cnt, ms, ex_c, ex_m);
    if (by_mass && target < 0) target = static_cast<double>(p) * static_cast<double>(s.total);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = static_cast<int>(threadIdx.x) * kPerThread + j;
      if (cnt[j] == 0) continue;
      atomicMin(&s.fallback, i);  // the top non-empty bucket: at least one logit is kept (e.g. a NaN target)
      if (by_mass) {
        // Buckets whose first logit is kept by top-p form a top range: the answer is its lowest non-empty one.
        if (static_cast<double>(mass_above + ex_m[j]) < target) atomicMax(&s.lowest, i);
      } else if (count_above + ex_c[j] < rank && count_above + ex_c[j] + cnt[j] >= rank) {
        s.lowest = i;
      }
    }
    __syncthreads();
    const int chosen = s.lowest >= 0 ? s.lowest : s.fallback;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (static_cast<int>(threadIdx.x) * kPerThread + j == chosen) {
        s.pick[level] = {nb - 1 - chosen, ex_c[j], cnt[j], ex_m[j]};
      }
    }
    __syncthreads();
    const Pick pk = s.pick[level];
    prefix |= static_cast<uint32_t>(pk.bucket) << shift;
    prefix_mask |= static_cast<uint32_t>(nb - 1) << shift;
    count_above += pk.count_above;
    mass_above += pk.mass_above;
    count_eq = pk.count_in;
  }
  key = prefix;
}

// The row's max (over all its CTAs' slices).
template <bool VEC>
__device__ float row_max(const float* x, int vocab, Scratch& s, const RowGroup& g) {
  float m = -INFINITY;
  for_each_logit<VEC>(x, vocab, [&](float v) { m = fmaxf(m, v); });
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) s.max[threadIdx.x / 32] = m;
  __syncthreads();
  m = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, s.max[w]);
  if (threadIdx.x == 0) s.row_max = m;
  g.sync();
  for (int r = 0; r < g.splits; ++r) m = fmaxf(m, *g.at(&s.row_max, r));
  return m;
}

// Grid: `splits` CTAs per row (a cluster of them when splits > 1, sm_90 only), CTA rank r on the r-th slice of
// the row (slices of whole 4-column groups, the last one shorter or empty). (Launch bounds with one CTA per SM:
// without the 1, nvcc 13 held the kernel to 32 registers and spilled the unrolled loads; it needs 56, ptxas -v.)
// top_k (int64, values >= vocab or < 1 = off), top_p (1 = off) and log_min_p (log of min_p, -inf = off) may
// each be null (off for every row).
template <bool VEC>
__global__ void __launch_bounds__(kThreads, 1)
    truncation_threshold_kernel(const float* __restrict__ logits, int64_t row_stride, int vocab, int splits,
                                const int64_t* __restrict__ top_k, const float* __restrict__ top_p,
                                const float* __restrict__ log_min_p, float* __restrict__ out) {
  pdl_enter();
  __shared__ Scratch s;
  const RowGroup g{splits, static_cast<int>(blockIdx.x % splits)};
  const int64_t row = blockIdx.x / splits;
  const int slice = ((vocab + 3) / 4 + splits - 1) / splits * 4;
  const int begin = min(vocab, g.rank * slice);
  const int n = min(vocab, begin + slice) - begin;
  const float* x = logits + row * row_stride + begin;
  const int64_t k64 = top_k != nullptr ? top_k[row] : vocab;
  const bool use_k = k64 >= 1 && k64 < vocab;
  const float p = top_p != nullptr ? top_p[row] : 1.f;
  const bool use_p = p < 1.f;
  const float lmp = log_min_p != nullptr ? log_min_p[row] : -INFINITY;
  float mx = -INFINITY;
  if (use_p || log_min_p != nullptr) mx = row_max<VEC>(x, n, s, g);
  uint32_t key = 0, k_key = 0;
  unsigned int above = 0, eq = 0;
  unsigned long long mass_above = 0;
  double target = -1.0;  // top-p on the whole row: p * total, found at the first level
  bool all_kept = !use_k;
  if (use_k) {
    const unsigned int k = static_cast<unsigned int>(k64);
    radix_select<VEC>(x, n, mx, false, use_p, k, p, 0.0, 0u, s, g, k_key, above, eq, mass_above);
    key = k_key;
    if (use_p) {  // top-k mass: everything above the k-th value plus as many of its ties as make k
      const unsigned long long mk = mass_above + (k - above) * fixed_mass(key_value(k_key), mx);
      target = static_cast<double>(p) * static_cast<double>(mk);
    }
  }
  if (use_p && mx > -INFINITY) {
    uint32_t p_key = 0;
    radix_select<VEC>(x, n, mx, true, true, 0u, p, target, k_key, s, g, p_key, above, eq, mass_above);
    key = max(key, p_key);
    all_kept = !use_k && above + eq >= static_cast<unsigned int>(vocab);
  }
  if (g.rank == 0 && threadIdx.x == 0) {
    const float thr = all_kept ? -INFINITY : key_value(key);
    out[row] = fmaxf(thr, __fadd_rn(mx, lmp));
  }
  if (splits > 1) g.sync();  // no CTA leaves while another may still read its shared memory
}

// CTAs per row: a cluster of up to kMaxSplits (the portable cluster size) on sm_90 when the rows alone leave SMs
// idle (one CTA fills an SM), each slice keeping at least kMinSliceColumns columns; else 1.
constexpr int kMaxSplits = 8;
constexpr int64_t kMinSliceColumns = 8192;

int threshold_splits(int64_t rows, int64_t vocab, int64_t requested) {
  if (current_cc_major() != 9) return 1;  // the clustered code is in the sm_90a build only
  int64_t want = requested;
  if (want <= 0) want = std::min<int64_t>(current_sm_count() / std::max<int64_t>(rows, 1), vocab / kMinSliceColumns);
  int splits = 1;
  while (splits * 2 <= std::min<int64_t>(want, kMaxSplits)) splits *= 2;
  return splits;
}

// Sets `attr` to a cluster of `ctas` CTAs and says whether the device can run one of them at all (a GPC with
// that many free SMs; a partitioned GPU may have none), asked once per device, kernel and size.
template <typename K>
bool clusters_fit(K kernel, int ctas, cudaLaunchAttribute (&attr)[1], cudaStream_t stream) {
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned int>(ctas);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices][2][kMaxSplits + 1];  // 0: not asked, 1: fits, 2: does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kCachedDevices) return false;
  const int vec = kernel == truncation_threshold_kernel<true> ? 1 : 0;
  std::atomic<int>& known = cache[device][vec][ctas];
  if (known.load(std::memory_order_relaxed) == 0) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned int>(ctas));
    cfg.blockDim = dim3(kThreads);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    const bool fits = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
    if (!fits) (void)cudaGetLastError();  // a failed query must not surface as the next launch's error
    known.store(fits ? 1 : 2, std::memory_order_relaxed);
  }
  return known.load(std::memory_order_relaxed) == 1;
}

}  // namespace

cudaError_t launch_truncation_threshold(const float* logits, int64_t row_stride, int64_t rows, int64_t vocab,
                                        const int64_t* top_k, const float* top_p, const float* log_min_p,
                                        float* out, int64_t splits, cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX / kMaxSplits || vocab <= 0 || vocab > kMaxThresholdVocab || splits < 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const bool vec = vocab % 4 == 0 && row_stride % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const auto kernel = vec ? truncation_threshold_kernel<true> : truncation_threshold_kernel<false>;
  int ctas = threshold_splits(rows, vocab, splits);
  cudaLaunchAttribute cluster[1];
  while (ctas > 1 && !clusters_fit(kernel, ctas, cluster, stream)) ctas /= 2;
  const dim3 grid(static_cast<unsigned int>(rows * ctas));
  const int v = static_cast<int>(vocab);
  return launch_kernel_with(cluster, ctas > 1 ? 1 : 0, kernel, grid, dim3(kThreads), 0, stream, logits, row_stride, v,
                            ctas, top_k, top_p, log_min_p, out);
}

}  // namespace minillm
