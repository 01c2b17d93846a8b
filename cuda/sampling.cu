// One-pass sampler: temperature + exponential race (Gumbel-max) + argmax over each row of logits.
//
// token = argmax_c(logit_c / T - log(E_c)) with E_c ~ Exp(1) is a draw from softmax(logits / T): each column
// is read once, its noise made on the fly, and no probabilities are ever written. Rows with inverse
// temperature 0 take the plain argmax (no noise). Ties go to the lowest column and NaN counts as the largest
// value, as in torch.argmax.
// Noise: Philox4x32-10 (the counter-based generator of Salmon et al., 2011, the one curand's
// curand_Philox4x32_10 computes) written out here because curand's headers are not part of every CUDA
// toolkit install this source must compile on. Key = seed (low word, high word); counter = (column / 4,
// row, offset low, offset high); column c uses output word c % 4. So a draw depends only on (seed, row,
// offset, column): the torch reference in minillm/ops/sampling_ops.py recomputes the same 32-bit words.
// Word x -> u = float(x) * 2^-32 + 2^-33 (fp32) in (0, 1]; E = -log1p(-u), so a small E (a likely winner)
// keeps full relative precision; u == 1 gives E = inf, a column that cannot win.
// Logits may be fp32, fp16 or bf16 (the lm_head output as it is, no fp32 copy); each is widened to fp32
// exactly, so the score of a column is the same fp32 number whichever of them holds the same value.
// Columns that provably cannot beat their thread's best so far skip the exact noise (and whole groups of four
// skip Philox): the same winner for a fraction of the logarithms (group_cannot_win, column_cannot_win).
// Variants: 16-byte loads (4 fp32 or 8 half-precision columns; vocab and row stride multiples of that,
// aligned) or scalar loads; and a column filter: none (the plain kernels, unchanged), a per-row truncation
// threshold (sampling_topp.cu: columns below it are read as -inf), or a grammar bitmask of some rows (a column
// whose bit is clear is read as -inf), so that constrained rows sample from their half-precision logits as they
// are instead of an fp32 copy masked in place.
//
// Grid (rows, splits). With many rows, one CTA of up to 1024 threads per row (splits = 1) and nothing else.
// With few rows (decode batches of 1-16 against 132 SMs) one CTA per row would leave most SMs idle, so each
// row's load chunks are cut into `splits` contiguous ranges (the last one shorter), one CTA each; the host picks
// splits so that rows * splits about fills the GPU once (race_splits). Each CTA reduces its range to a best
// (score, column) and writes it to a workspace [rows, splits]; then it takes a ticket of its row (atomicAdd
// after a __threadfence, so its partial is visible before the ticket counts it). The CTA that draws the last
// ticket merges the row's partials and writes the token.
// Same token as one CTA per row, bit for bit, whatever the split count or the order CTAs finish in: a column's
// score depends only on (seed, row, offset, column, logit, inv_temperature); "beats" is a total order on
// (score, column), so the best of the bests is the best; and pruning only skips columns whose exact score is
// below a score some column of the row reaches, which cannot be the row's best however the columns are shared.
// Workspace: fresh per call from the caller (the torch caching allocator in fused_bindings.cpp, which under
// CUDA graph capture hands out memory of the graph's private pool, fixed across replays); its tickets are
// zeroed by a cudaMemsetAsync on the launch stream (a memset node when captured), so any launch or replay
// starts from zero tickets whatever the memory held before.
// Compile-only check: nvcc -c -gencode arch=compute_90a,code=sm_90a -Xptxas -v cuda/sampling.cu
#include <algorithm>
#include <atomic>
#include <cmath>

#include "fused.h"
#include "launch.h"

namespace minillm {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k.x += 0x9E3779B9u;
      k.y += 0xBB67AE85u;
    }
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// u in (0, 1] from one 32-bit word; same fp32 steps as the torch reference.
__device__ __forceinline__ float unit_from_word(uint32_t x) {
  return __fadd_rn(__fmul_rn(__uint2float_rn(x), 2.3283064365386963e-10f), 1.1641532182693481e-10f);
}

// -log(E) for E ~ Exp(1) made from one 32-bit word; same fp32 steps as the torch reference.
__device__ __forceinline__ float neg_log_exponential(uint32_t x) { return -logf(-log1pf(-unit_from_word(x))); }

struct Best {
  float v;
  int i;
};

// True when (v, i) beats b: larger value, NaN above all, lower index on ties.
__device__ __forceinline__ bool beats(float v, int i, const Best& b) {
  if (isnan(v)) return !isnan(b.v) || i < b.i;
  if (isnan(b.v)) return false;
  return v > b.v || (v == b.v && i < b.i);
}

__device__ __forceinline__ Best block_argmax(Best b) {
  __shared__ Best red[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int i = __shfl_xor_sync(0xffffffffu, b.i, o);
    if (beats(v, i, b)) b = {v, i};
  }
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if ((threadIdx.x & 31) == 0) red[warp] = b;
  __syncthreads();
  if (warp == 0) {
    b = threadIdx.x < warps ? red[threadIdx.x] : Best{-INFINITY, INT32_MAX};
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
      const int i = __shfl_xor_sync(0xffffffffu, b.i, o);
      if (beats(v, i, b)) b = {v, i};
    }
  }
  return b;
}

// The score of a column on a sampled row: l * inv_t + (-log E), each step rounded to fp32 (a greedy row's
// score is l itself).
__device__ __forceinline__ float race_score(float l, float inv_t, uint32_t word) {
  return __fadd_rn(__fmul_rn(l, inv_t), neg_log_exponential(word));
}

// Pruning (sampled rows): most columns cannot beat the thread's best so far, and proving that is cheaper than
// the two accurate logarithms of their noise. Both tests below only skip a column whose exact score is
// certainly below the best, so the winner (ties and NaN included) is the one the full race picks.
// u >= 2^-33, so E = -log1p(-u) >= u >= 2^-33 and the noise -log(E) <= 33 ln 2 < kMaxNoise, for every column.
constexpr float kMaxNoise = 22.9f;
// Margin for fp32 rounding (products, log1pf / logf within 2 ulp) and for __logf's approximation error:
// orders of magnitude above those errors, orders below the gaps that prune.
__device__ __forceinline__ float slack(float v) { return 1e-3f + 1e-4f * fabsf(v); }

// True when no column of a Philox group, whose largest scaled logit is xmax (NaN if any is NaN), can win.
__device__ __forceinline__ bool group_cannot_win(float xmax, const Best& best) {
  return xmax + kMaxNoise + slack(xmax) < best.v;  // false for NaN
}

// True when the column with scaled logit x and noise word `word` cannot win: E >= u gives -log(E) <= -log(u),
// which the fast __logf bounds up to its error.
__device__ __forceinline__ bool column_cannot_win(float x, uint32_t word, const Best& best) {
  const float noise_bound = -__logf(unit_from_word(word));
  return x + noise_bound + slack(noise_bound) + slack(x) < best.v;
}

// Columns per load chunk: 16 / sizeof(T) for 16-byte loads (one Philox group of 4 for fp32, two for 2-byte
// types), else 4 scalar loads (one group). The noise of column c is word c % 4 of group c / 4 either way.
template <typename T, bool VEC>
constexpr int kChunkCols = VEC ? 16 / static_cast<int>(sizeof(T)) : 4;

// The logits of chunk k, widened to fp32; scalar loads read -inf past the last column.
template <typename T, bool VEC>
__device__ __forceinline__ void load_chunk(const T* x, int k, int vocab, float (&l)[kChunkCols<T, VEC>]) {
  constexpr int kCols = kChunkCols<T, VEC>;
  if constexpr (VEC) {
    fused_detail::load_vec<T, kCols>(x + kCols * k, l);
  } else {
#pragma unroll
    for (int e = 0; e < kCols; ++e) {
      l[e] = kCols * k + e < vocab ? fused_detail::to_float(x[kCols * k + e]) : -INFINITY;
    }
  }
}

// Folds the 4 columns of Philox group g (logits l[0..3]) of a greedy row into best.
template <bool VEC>
__device__ __forceinline__ void argmax_group(const float* l, int g, int vocab, Best& best) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int col = 4 * g + e;
    if (!VEC && col >= vocab) break;
    if (beats(l[e], col, best)) best = {l[e], col};
  }
}

// Folds the 4 columns of Philox group g (logits l[0..3]) of a sampled row into best, skipping the noise of
// columns (or the whole group) that cannot win.
// (Key and counter words come one by one: gathered in a struct, they led nvcc 13 to keep the 18 Philox round
// keys live across the scan loop, 49 registers instead of 31, and one 1024-thread CTA per SM instead of two.)
template <bool VEC>
__device__ __forceinline__ void race_group(const float* l, int g, int vocab, float inv_t, uint32_t row, uint2 key,
                                           uint32_t offset_lo, uint32_t offset_hi, Best& best) {
  float xmax = -INFINITY;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float xe = __fmul_rn(l[e], inv_t);
    xmax = (xe > xmax || isnan(xe)) ? xe : xmax;
  }
  if (group_cannot_win(xmax, best)) return;
  const uint4 w = philox4x32_10(make_uint4(static_cast<uint32_t>(g), row, offset_lo, offset_hi), key);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int col = 4 * g + e;
    if (!VEC && col >= vocab) break;
    if (column_cannot_win(__fmul_rn(l[e], inv_t), words[e], best)) continue;
    const float s = race_score(l[e], inv_t, words[e]);
    if (beats(s, col, best)) best = {s, col};
  }
}

enum class Filter { kNone, kThreshold, kBitmask };

// The bitmask row of batch row `row`: every row's own when rows is null, else the index of `row` in the
// ascending list rows[0, n) (binary search), or null when the row is not constrained.
__device__ __forceinline__ const int32_t* bitmask_row(const RaceFilter& f, int64_t row) {
  if (f.mask_rows == nullptr) return f.bitmask + row * f.words;
  int lo = 0, hi = f.num_mask_rows;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (f.mask_rows[mid] < row) lo = mid + 1; else hi = mid;
  }
  return lo < f.num_mask_rows && f.mask_rows[lo] == row ? f.bitmask + lo * f.words : nullptr;
}

// This thread's best over chunks begin + threadIdx.x, + blockDim.x, ... below end of row `row` (at x).
// Index `vocab` is past every column: any real column, even at -inf, beats that start on the tie rule.
// kThreshold: columns below `thr` (the row's truncation threshold) count as -inf, as the torch path masks them.
// kBitmask: columns whose bit in `bits` (the row's bitmask words, null: an unconstrained row) is clear count as
// -inf. A chunk's 4 or 8 columns lie in one 32-bit word (chunks start at multiples of their width).
template <typename T, bool VEC, Filter F>
__device__ __forceinline__ Best scan_chunks(const T* x, int vocab, float inv_t, uint32_t row, uint2 key,
                                            uint32_t offset_lo, uint32_t offset_hi, int begin, int end, float thr,
                                            const int32_t* bits) {
  constexpr int kCols = kChunkCols<T, VEC>;
  constexpr int kGroups = kCols / 4;  // Philox calls per chunk
  const bool greedy = inv_t == 0.f;
  Best best{-INFINITY, vocab};
  for (int k = begin + static_cast<int>(threadIdx.x); k < end; k += blockDim.x) {
    float l[kCols];
    load_chunk<T, VEC>(x, k, vocab, l);
    if constexpr (F == Filter::kThreshold) {
#pragma unroll
      for (int e = 0; e < kCols; ++e) l[e] = l[e] < thr ? -INFINITY : l[e];
    }
    if constexpr (F == Filter::kBitmask) {
      if (bits != nullptr) {
        const int c0 = kCols * k;
        const uint32_t word = static_cast<uint32_t>(__ldg(bits + (c0 >> 5)));
#pragma unroll
        for (int e = 0; e < kCols; ++e) l[e] = (word >> ((c0 + e) & 31)) & 1u ? l[e] : -INFINITY;
      }
    }
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      if (greedy) {
        argmax_group<VEC>(l + 4 * j, kGroups * k + j, vocab, best);
      } else {
        race_group<VEC>(l + 4 * j, kGroups * k + j, vocab, inv_t, row, key, offset_lo, offset_hi, best);
      }
    }
  }
  return best;
}

// Split rows, after block_argmax (thread 0 holds this CTA's best): publishes the partial and takes the row's
// ticket. Returns true (uniformly over the CTA) in the CTA that drew the last ticket, with the row's best of all
// partials in thread 0's `best`. The ticket is left as it is: every launch zeroes the tickets first (memset).
__device__ bool merge_split(Best& best, Best* partials, unsigned int* ticket) {
  __shared__ bool last;
  const unsigned int splits = gridDim.y;
  if (threadIdx.x == 0) {
    partials[blockIdx.y] = best;
    __threadfence();  // the partial is visible device-wide before the ticket counts it
    last = atomicAdd(ticket, 1u) == splits - 1;
    __threadfence();  // and the partials counted before the last ticket are read after it
  }
  __syncthreads();
  if (!last) return false;
  Best b{-INFINITY, INT32_MAX};
  for (unsigned int s = threadIdx.x; s < splits; s += blockDim.x) {
    // L2 loads (ld.cg): the partials were written by other SMs.
    const float v = __ldcg(&partials[s].v);
    const int i = __ldcg(&partials[s].i);
    if (beats(v, i, b)) b = {v, i};
  }
  best = block_argmax(b);
  return true;
}

// Grid (rows, splits): CTA (row, s) scans load chunks [s * split_chunks, (s + 1) * split_chunks) of its row.
// partials [rows, splits] and tickets [rows] (zero at launch) are used only when splits > 1.
template <typename T, bool VEC, Filter F>
__global__ void __launch_bounds__(kThreads)
    exponential_race_kernel(const T* __restrict__ logits, int64_t row_stride,
                            const float* __restrict__ inv_temperature, const RaceFilter filter,
                            int64_t* __restrict__ out, int vocab,
                            int split_chunks, Best* partials, unsigned int* tickets, uint2 key, uint32_t offset_lo,
                            uint32_t offset_hi) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  const uint32_t row = blockIdx.x;
  const int chunks = (vocab + kChunkCols<T, VEC> - 1) / kChunkCols<T, VEC>;
  const int begin = static_cast<int>(blockIdx.y) * split_chunks;
  const int end = min(chunks, begin + split_chunks);
  const float thr = F == Filter::kThreshold ? filter.threshold[row] : 0.f;
  const int32_t* bits = F == Filter::kBitmask ? bitmask_row(filter, row) : nullptr;
  Best best = block_argmax(scan_chunks<T, VEC, F>(logits + row * row_stride, vocab, inv_temperature[row], row, key,
                                                  offset_lo, offset_hi, begin, end, thr, bits));
  if (gridDim.y > 1 && !merge_split(best, partials + static_cast<int64_t>(row) * gridDim.y, tickets + row)) return;
  if (threadIdx.x == 0) out[row] = best.i;
}

// Split rule. A split keeps at least kMinSplitColumns columns, so that its scan still outweighs the CTA's fixed
// costs (block reduction, ticket, merge). The kernel fits in 32 registers (ptxas -v), so two CTAs of 1024
// threads share an SM: rows * splits <= 2 * SMs fills the GPU once, and rows > SMs gives splits = 1.
constexpr int64_t kMinSplitColumns = 4096;
constexpr int64_t kCtasPerSm = 2;

int race_splits(int64_t rows, int64_t vocab, int sms) {
  const int64_t by_width = vocab / kMinSplitColumns;
  const int64_t by_grid = kCtasPerSm * sms / rows;
  return static_cast<int>(std::max<int64_t>(1, std::min({by_width, by_grid, int64_t{kMaxRaceSplits}})));
}

}  // namespace

// An attribute of the current device, asked once per device: the sampler runs every decode step. 0 if the query
// fails (every attribute cached here is > 0).
template <cudaDeviceAttr kAttr>
int cached_device_attribute() {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device >= 0 && device < kCachedDevices) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttr, device) != cudaSuccess) return 0;
  if (device >= 0 && device < kCachedDevices) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

int current_sm_count() { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(); }
int current_cc_major() { return cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(); }
int current_smem_per_sm() { return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(); }
int current_smem_optin() { return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }

namespace {

template <typename T, bool VEC>
auto race_kernel(const RaceFilter& f) {
  return f.threshold != nullptr  ? exponential_race_kernel<T, VEC, Filter::kThreshold>
         : f.bitmask != nullptr ? exponential_race_kernel<T, VEC, Filter::kBitmask>
                                : exponential_race_kernel<T, VEC, Filter::kNone>;
}

template <typename T>
cudaError_t launch_race(const T* logits, int64_t row_stride, const float* inv_temperature, const RaceFilter& filter,
                        int64_t* out, int64_t rows, int64_t vocab, int splits, void* workspace, uint2 key, uint32_t lo,
                        uint32_t hi, cudaStream_t stream) {
  constexpr int kVecCols = 16 / static_cast<int>(sizeof(T));
  const bool vec = vocab % kVecCols == 0 && row_stride % kVecCols == 0 &&
                   reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const int64_t chunks = vec ? vocab / kVecCols : (vocab + 3) / 4;
  const int64_t split_chunks = (chunks + splits - 1) / splits;
  const int used = static_cast<int>((chunks + split_chunks - 1) / split_chunks);  // no empty range
  const int threads = split_chunks >= kThreads ? kThreads : static_cast<int>((split_chunks + 31) / 32 * 32);
  Best* partials = nullptr;
  unsigned int* tickets = nullptr;
  if (used > 1) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    partials = static_cast<Best*>(workspace);
    tickets = reinterpret_cast<unsigned int*>(partials + rows * splits);  // laid out for `splits` >= used
    const cudaError_t err = cudaMemsetAsync(tickets, 0, rows * sizeof(unsigned int), stream);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned int>(rows), static_cast<unsigned int>(used));
  const int v = static_cast<int>(vocab), sc = static_cast<int>(split_chunks);
  // Without a filter, the kernels of plain temperature sampling as they were (Filter::kNone compiles it out).
  const auto kernel = vec ? race_kernel<T, true>(filter) : race_kernel<T, false>(filter);
  return launch_kernel(kernel, grid, dim3(threads), 0, stream, logits, row_stride, inv_temperature, filter, out, v,
                       sc, partials, tickets, key, lo, hi);
}

// Seeded rows' noise (sampler.py's torch path): noise[row, c] = E ~ Exp(1) for each listed row, keyed by the
// request's own seed and by the index of the output token being sampled (args' position + offset: a batch
// reused for the next step adds 1), never by the row or the batch, so a seeded request draws the same noise
// alone or in any batch. Philox4x32-10 with key = seed (low word, high word) and counter = (c / 4, position
// low, position high, kSeededTag), word c % 4; E = -log1pf(-u) with u from unit_from_word (log1pf is what
// torch's CUDA log1p calls, so the torch twin on the GPU agrees bit for bit). One thread per Philox group of a
// row; grid (groups / threads, rows listed).
constexpr uint32_t kSeededTag = 0x53454544u;  // "SEED": apart from the race's counters (whose 4th word is small)
constexpr int kNoiseThreads = 256;

__global__ void __launch_bounds__(kNoiseThreads)
    seeded_exponential_kernel(float* __restrict__ noise, int64_t row_stride, int64_t rows, int vocab,
                              const int64_t* __restrict__ args, int listed, uint64_t offset) {
  pdl_enter();
  const int i = blockIdx.y;
  const int g = blockIdx.x * kNoiseThreads + threadIdx.x;
  const int64_t row = args[i];
  if (4 * static_cast<int64_t>(g) >= vocab || row < 0 || row >= rows) return;
  const uint64_t seed = static_cast<uint64_t>(args[listed + i]);
  const uint64_t pos = static_cast<uint64_t>(args[2 * listed + i]) + offset;
  const uint4 w = philox4x32_10(
      make_uint4(static_cast<uint32_t>(g), static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32), kSeededTag),
      make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float* out = noise + row * row_stride;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int col = 4 * g + e;
    if (col < vocab) out[col] = -log1pf(-unit_from_word(words[e]));
  }
}

}  // namespace

cudaError_t launch_seeded_exponential(float* noise, int64_t row_stride, int64_t rows, int64_t vocab,
                                      const int64_t* args, int64_t listed, uint64_t offset, cudaStream_t stream) {
  if (rows < 0 || vocab <= 0 || vocab > kMaxVocab - 4 || listed < 0 || listed > 65535) return cudaErrorInvalidValue;
  if (listed == 0 || rows == 0) return cudaSuccess;
  const int64_t groups = (vocab + 3) / 4;
  const dim3 grid(static_cast<unsigned int>((groups + kNoiseThreads - 1) / kNoiseThreads),
                  static_cast<unsigned int>(listed));
  return launch_kernel(seeded_exponential_kernel, grid, dim3(kNoiseThreads), 0, stream, noise, row_stride, rows,
                       static_cast<int>(vocab), args, static_cast<int>(listed), offset);
}

int sample_exponential_race_splits(int64_t rows, int64_t vocab, int64_t requested) {
  if (requested > 0) return static_cast<int>(std::min<int64_t>(requested, kMaxRaceSplits));
  if (rows <= 0 || vocab <= 0) return 1;
  const int sms = current_sm_count();
  return sms > 0 ? race_splits(rows, vocab, sms) : 1;
}

int64_t sample_exponential_race_workspace_bytes(int64_t rows, int splits) {
  if (splits <= 1) return 0;
  return rows * splits * static_cast<int64_t>(sizeof(Best)) + rows * static_cast<int64_t>(sizeof(unsigned int));
}

cudaError_t launch_sample_exponential_race(const void* logits, int64_t row_stride, const float* inv_temperature,
                                           const RaceFilter& filter, int64_t* out, int64_t rows, int64_t vocab,
                                           uint64_t seed,
                                           uint64_t offset, int splits, void* workspace, ScalarType logits_dtype,
                                           cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX || vocab <= 0 || vocab > kMaxVocab - 4) return cudaErrorInvalidValue;
  if (splits < 1 || splits > kMaxRaceSplits) return cudaErrorInvalidValue;
  if (filter.threshold != nullptr && filter.bitmask != nullptr) return cudaErrorInvalidValue;
  if (filter.bitmask != nullptr && (filter.words < (vocab + 31) / 32 || filter.num_mask_rows < 0 ||
                                    (filter.mask_rows == nullptr && filter.num_mask_rows != rows))) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const uint2 key = make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint32_t lo = static_cast<uint32_t>(offset), hi = static_cast<uint32_t>(offset >> 32);
  return fused_detail::dispatch_dtype(logits_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_race(static_cast<const T*>(logits), row_stride, inv_temperature, filter, out, rows, vocab,
                       splits, workspace, key, lo, hi, stream);
  });
}

}  // namespace minillm
