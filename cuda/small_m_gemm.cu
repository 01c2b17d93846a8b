// Small-M GEMM for decode: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias), M = 1 .. 256 tokens, bf16 / fp16.
//
// Why not cuBLAS: at decode sizes a layer GEMM reads 4-13 MB of weights (1-3 us of HBM time) but cuBLAS spends
// 5-8 us on it (launch, ramp-up, separate split-K reduce kernels). This kernel is launched with programmatic
// dependent launch and starts streaming its weight tiles into shared memory *before* pdl_wait(), i.e. while the
// previous kernel is still finishing; only X (written by that kernel) waits.
//
// Layout: A and B are swapped so the tensor-core M side is the weight dimension. A CTA computes the Y^T tile
// W[n0 : n0+64, k-slice] . X[m0 : m0+MT, k-slice]^T with mma.sync m16n8k16 (row.col): weight rows are the
// MMA's 16-row side, tokens its 8-column side, so a small M pads to 16 tokens, not to 64.
//   grid = (N / 64, ceil(M / MT), split): x = weight-row tile, y = token tile (1 unless forced), z = K split.
//   8 warps: 2 along the 64 weight rows (32 rows = two 16-row A tiles each) x 4 along the tokens; token tiles of
//   16 are dealt to the 4 token warps round-robin (tile t -> warp t % 4), so a partly filled MT stays balanced,
//   and MMAs / fragment loads of tiles past the real token count are skipped (warp-uniform branches).
//
// Pipeline: BK = 64 (one 128-byte row segment = 8 16-byte chunks per row), XOR-swizzled shared memory (swz<8>),
// ldmatrix for both operands (both are K-contiguous rows: W rows and X rows). Weights and activations have
// separate cp.async rings: kStagesW weight stages and SX activation stages. The two are issued by different
// warps (warps 0-3 copy W, warps 4-7 copy X) because cp.async groups complete in issue order *per thread*: if
// one thread issued both, waiting for X(j) would also wait for every weight stage it had prefetched earlier
// (all of them, right after pdl_wait), and the first MMA would start only when the whole prefetch has landed.
// Per thread, the group accounting is then a plain ring (documented at the main loop).
//
// Split-K: with few weight-row tiles (N = 1024), K is cut into `split` slices so the grid fills the GPU. Each
// CTA stores its fp32 accumulators to a workspace slot in register-fragment order (coalesced float4 stores,
// read back by the same thread index), fences, and takes a ticket from the tile's counter; the CTA drawing the
// last ticket sums all slices in split order 0, 1, 2, ... (so the result does not depend on which CTA came
// last: deterministic), resets the counter to 0 (the buffer needs no memset between launches) and writes Y.
//
// Epilogue: fp32 accumulators (+ bias, in fp32) rounded once to T, staged through shared memory as a
// [tokens][64] tile and written to Y with 16-byte coalesced stores; token rows past M are never stored.
#include "common.cuh"
#include "gemm.h"
#include "pdl.cuh"

namespace minillm {
namespace {

constexpr int kBN = kSmallMTileN;  // weight rows per CTA
constexpr int kBK = kSmallMTileK;  // k per stage
constexpr int kChunks = kBK / 8;   // 16-byte chunks per tile row
constexpr int kWarpsN = 2;         // warps along the weight rows (32 rows each)
constexpr int kWarpsM = 4;         // warps along the tokens
constexpr int kThreads = 32 * kWarpsN * kWarpsM;
constexpr int kLoaders = kThreads / 2;  // threads of each copy role (warps 0-3: W, warps 4-7: X)
// Weight stages: kStagesW - 1 = 5 stages (40 KB) are in flight per CTA, two CTAs per SM where shared memory
// allows: ~80 KB per SM outstanding, what HBM needs to stream near its peak (Little's law, ~1 us latency).
constexpr int kStagesW = 6;
constexpr int kStageElemsW = kBN * kBK;

static_assert(kBN == kWarpsN * 32, "each N warp owns two 16-row MMA tiles");
static_assert(kBN * kChunks % kLoaders == 0, "weight stage chunks split evenly over the W copy threads");

template <int MT>
struct Cfg {
  static_assert(MT % (16 * kWarpsM) == 0, "token tile must be whole 16-token tiles for each token warp");
  static constexpr int TT = MT / (16 * kWarpsM);  // 16-token tiles per warp
  static constexpr int NT = 2 * TT;               // 8-token MMA column tiles per warp
  static constexpr int SX = MT <= 64 ? 4 : 3;     // activation stages (X is L2-resident: short latency)
};

constexpr int smem_bytes(int sx, int x_rows) { return (kStagesW * kStageElemsW + sx * x_rows * kBK) * 2; }

struct GemmParams {
  const void* x;      // token 0 (the kernel adds blockIdx.y * MT rows)
  int64_t ldx;
  const void* w;
  const void* bias;
  void* y;
  int m, n, k;
  int ksteps;         // k / kBK
  int split;          // gridDim.z
  int x_rows;         // rows of one X stage in shared memory (min(MT, M rounded up to 16))
  float* ws;          // split > 1: [tiles][split][NF4][kThreads] float4
  int* counters;      // split > 1: [tiles]
};

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// One 64 x 64 weight tile (rows n0.., k0..) into a stage: 512 chunks, 4 per W-copy thread `t`; eight
// consecutive threads read one row's 128 contiguous bytes.
template <typename T>
__device__ __forceinline__ void load_w_stage(T* dst, const T* w, int k, int n0, int k0, int t) {
  const int c = t % kChunks;
#pragma unroll
  for (int i = 0; i < kBN * kChunks / kLoaders; ++i) {
    const int r = t / kChunks + i * (kLoaders / kChunks);
    cp_async16(dst + swz<kChunks>(r, c), w + (int64_t)(n0 + r) * k + k0 + c * 8, 16);
  }
}

// rows16 token rows of X (x points at the CTA's first token) into a stage; rows >= `rows` (past M) are
// zero-filled without reading global memory, so padded MMA columns compute on zeros.
template <typename T>
__device__ __forceinline__ void load_x_stage(T* dst, const T* x, int64_t ldx, int rows, int rows16, int k0,
                                             int t) {
  for (int i = t; i < rows16 * kChunks; i += kLoaders) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < rows;
    cp_async16(dst + swz<kChunks>(r, c), valid ? x + r * ldx + k0 + c * 8 : x, valid ? 16 : 0);
  }
}

// acc[i][nt] += W rows (wn*32 + i*16 ..+16) . X tokens (16 * (t*kWarpsM + wm) + (nt&1)*8 ..+8), nt = 2t + (0|1),
// over one 64-deep stage.
//   A (16x16, W rows x k) from ldmatrix.x4: lanes 0-15 address rows 0-15 at k chunk 0, lanes 16-31 rows 0-15 at
//     chunk 1, giving a0 (rows 0-7, k 0-7), a1 (rows 8-15, k 0-7), a2 (rows 0-7, k 8-15), a3 (rows 8-15, k 8-15).
//   B (16x8 col-major = 8 token rows x 16 k) from ldmatrix.x4 over 16 tokens: lanes 0-7 tokens 0-7 chunk 0 (b0 of
//     tokens 0-7), lanes 8-15 tokens 0-7 chunk 1 (b1), lanes 16-23 tokens 8-15 chunk 0, lanes 24-31 chunk 1.
template <typename T, int TT>
__device__ __forceinline__ void mma_stage(float (&acc)[2][2 * TT][4], const T* sw, const T* sx, int wn, int wm,
                                          int lane, int rows16) {
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    uint32_t a[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      ldmatrix_x4(a[i], sw + swz<kChunks>(wn * 32 + i * 16 + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      const int tb = (t * kWarpsM + wm) * 16;
      if (tb < rows16) {
        uint32_t b[4];
        ldmatrix_x4(b, sx + swz<kChunks>(tb + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mma16816<T>(acc[i][2 * t], a[i], b[0], b[1]);
          mma16816<T>(acc[i][2 * t + 1], a[i], b[2], b[3]);
        }
      }
    }
  }
}

// Workspace slot of (tile, split slice z) for this thread: float4 index f lives at [f * kThreads + tid].
template <int NF4>
__device__ __forceinline__ float4* ws_slot(float* ws, int tile, int split, int z) {
  return reinterpret_cast<float4*>(ws) + ((int64_t)tile * split + z) * NF4 * kThreads + threadIdx.x;
}

// Split-K: publish this CTA's partial sums, take a ticket; the last CTA of the tile gets the sum of all slices
// (in slice order) in acc and returns true, every other CTA returns false and is done.
template <int TT>
__device__ __forceinline__ bool reduce_split_k(float (&acc)[2][2 * TT][4], const GemmParams& p, int tile, int wm,
                                               int rows16) {
  constexpr int NF4 = 4 * TT;
  __shared__ int s_last;
  float4* mine = ws_slot<NF4>(p.ws, tile, p.split, blockIdx.z);
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if ((t * kWarpsM + wm) * 16 >= rows16) continue;  // never computed, never read back
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* v = acc[i][2 * t + h];
        __stcg(mine + ((t * 2 + i) * 2 + h) * kThreads, make_float4(v[0], v[1], v[2], v[3]));
      }
  }
  __threadfence();  // this thread's partials are visible device-wide before the ticket below is taken
  __syncthreads();  // ... for every thread of the CTA
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(p.counters + tile, 1);
    s_last = ticket == p.split - 1;
    // Every slice has taken its ticket: nobody touches this counter again in this launch, and the next launch
    // that uses it starts after this grid has completed (stream order; its pdl_wait() for a PDL launch).
    if (s_last) p.counters[tile] = 0;
  }
  __syncthreads();
  if (!s_last) return false;
  __threadfence();  // acquire side: the other slices' partials are read after their tickets were observed
  for (int z = 0; z < p.split; ++z) {
    const float4* src = ws_slot<NF4>(p.ws, tile, p.split, z);
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if ((t * kWarpsM + wm) * 16 >= rows16) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // L2 reads (.cg): the slices were written by other SMs; this CTA's own slice is read back the same way
          // so every slice enters the sum identically.
          const float4 v = __ldcg(src + ((t * 2 + i) * 2 + h) * kThreads);
          float* d = acc[i][2 * t + h];
          if (z == 0) {
            d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
          } else {
            d[0] += v.x; d[1] += v.y; d[2] += v.z; d[3] += v.w;
          }
        }
    }
  }
  return true;
}

// acc (+ bias) -> T, staged in shared memory as a [rows16][64] swizzled tile, then 16-byte stores of the rows
// that exist. Accumulator element e of acc[i][nt] is weight row g + 8 * (e >> 1) of A tile i and token
// 2 * (lane % 4) + (e & 1) of column tile nt (g = lane / 4), the m16n8 C-fragment layout.
template <typename T, int TT>
__device__ __forceinline__ void store_output(const float (&acc)[2][2 * TT][4], const GemmParams& p, T* stage,
                                             int n0, int m0, int rows, int rows16, int wn, int wm, int lane) {
  const int g = lane >> 2, tig = lane & 3;
  float bias[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  if (p.bias != nullptr) {
    const T* b = static_cast<const T*>(p.bias) + n0 + wn * 32 + g;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) bias[i][h] = to_float(b[i * 16 + h * 8]);
  }
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    const int tb = (t * kWarpsM + wm) * 16;
    if (tb >= rows16) continue;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = tb + h2 * 8 + 2 * tig + (e & 1);
          const int col = wn * 32 + i * 16 + g + 8 * (e >> 1);
          stage[swz<kChunks>(tok, col >> 3) + (col & 7)] =
              DType<T>::from_float(acc[i][2 * t + h2][e] + bias[i][e >> 1]);
        }
  }
  __syncthreads();
  T* y = static_cast<T*>(p.y) + (int64_t)m0 * p.n + n0;
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    *reinterpret_cast<uint4*>(y + (int64_t)r * p.n + c * 8) =
        *reinterpret_cast<const uint4*>(stage + swz<kChunks>(r, c));
  }
}

// At most 128 registers (two CTAs per SM): shared memory allows two up to 160 tokens (MT = 256: 102 KB at 144).
template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, 2) small_m_gemm_kernel(const GemmParams p) {
  using C = Cfg<MT>;
  constexpr int SX = C::SX;
  extern __shared__ uint4 smem_raw[];
  T* sW = reinterpret_cast<T*>(smem_raw);
  T* sX = sW + kStagesW * kStageElemsW;
  const int x_stage = p.x_rows * kBK;

  pdl_trigger();  // the next kernel may become resident now; it waits for our completion in its pdl_wait()

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wn = warp % kWarpsN, wm = warp / kWarpsN;
  const bool copies_w = warp < kLoaders / 32;
  const int lt = threadIdx.x % kLoaders;  // index within the copy role
  const int n0 = blockIdx.x * kBN, m0 = blockIdx.y * MT;
  const int rows = min(MT, p.m - m0);      // tokens of this tile
  const int rows16 = (rows + 15) & ~15;    // tokens the MMAs cover
  // This CTA's k-steps [kb, kb + nk): slices differ by at most one step.
  const int kb = (int)((int64_t)p.ksteps * blockIdx.z / p.split);
  const int nk = (int)((int64_t)p.ksteps * (blockIdx.z + 1) / p.split) - kb;
  const T* w = static_cast<const T*>(p.w);
  const T* x = static_cast<const T*>(p.x) + (int64_t)m0 * p.ldx;

  // cp.async group accounting, per thread (groups complete in commit order):
  //   W-copy threads commit kStagesW - 1 groups in the prologue (W stages 0 .. kStagesW - 2, before pdl_wait)
  //     and exactly one per main-loop iteration j (W stage j + kStagesW - 1, possibly empty). Before iteration
  //     j, (kStagesW - 1) + j groups are committed and W stage j is group j, so wait_group<kStagesW - 2> leaves
  //     it complete.
  //   X-copy threads do the same with SX (prologue after pdl_wait): wait_group<SX - 2> in iteration j.
  //   The __syncthreads after the waits publishes both stages to every warp, and shows that every warp has
  //   finished iteration j - 1, whose slots (j - 1) % S are the ones refilled in iteration j.
  if (copies_w) {
#pragma unroll
    for (int s = 0; s < kStagesW - 1; ++s) {
      if (s < nk) load_w_stage(sW + s * kStageElemsW, w, p.k, n0, (kb + s) * kBK, lt);
      cp_async_commit();
    }
  }
  pdl_wait();  // from here on: X, Y, the workspace and the counters (all may be used by earlier kernels)
  if (!copies_w) {
#pragma unroll
    for (int s = 0; s < SX - 1; ++s) {
      if (s < nk) load_x_stage(sX + s * x_stage, x, p.ldx, rows, rows16, (kb + s) * kBK, lt);
      cp_async_commit();
    }
  }

  float acc[2][C::NT][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < C::NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  const bool computes = wm * 16 < rows16;  // this warp owns at least one real token tile
  for (int j = 0; j < nk; ++j) {
    if (copies_w) {
      cp_async_wait<kStagesW - 2>();
    } else {
      cp_async_wait<SX - 2>();
    }
    __syncthreads();
    if (copies_w) {
      const int jw = j + kStagesW - 1;
      if (jw < nk) load_w_stage(sW + (jw % kStagesW) * kStageElemsW, w, p.k, n0, (kb + jw) * kBK, lt);
    } else {
      const int jx = j + SX - 1;
      if (jx < nk) load_x_stage(sX + (jx % SX) * x_stage, x, p.ldx, rows, rows16, (kb + jx) * kBK, lt);
    }
    cp_async_commit();
    if (computes)
      mma_stage<T, C::TT>(acc, sW + (j % kStagesW) * kStageElemsW, sX + (j % SX) * x_stage, wn, wm, lane, rows16);
  }
  cp_async_wait<0>();  // only empty groups remain; nothing may be in flight into the smem reused below
  __syncthreads();     // every warp is done reading the stages

  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (p.split > 1 && !reduce_split_k<C::TT>(acc, p, tile, wm, rows16)) return;
  store_output<T, C::TT>(acc, p, sW, n0, m0, rows, rows16, wn, wm, lane);
}

// ---- host side ---------------------------------------------------------------------------------------------

int num_x_stages(int tile_m) { return tile_m <= 64 ? Cfg<64>::SX : tile_m <= 128 ? Cfg<128>::SX : Cfg<256>::SX; }

// Split-K choice: an explicit cost model, in units of "every SM streams one 64 x 64 weight k-step at its share
// of HBM bandwidth". For split s:
//   waves(s)  = ceil(tiles * s / sms)        CTAs per SM, run one after another (or side by side, sharing it)
//   steps(s)  = ceil(ksteps / s) + 1         k-steps per CTA, +1 for the pipeline fill every CTA pays
//   mma       = max(1, x_rows / 128)         past ~128 tokens a k-step's mma.sync work outlasts its weight load
//                                            (H100: ~600 dense TFLOPS with mma.sync vs ~4 TB/s: ridge ~150 flop/B)
//   reduce(s) = s > 1 ? s * tiles * x_rows / (32 * sms) : 0
//               fp32 partials written and read back (s * tiles * x_rows * 64 * 8 bytes) through L2, taken as ~2x
//               HBM speed: 8 KB per SM per unit at HBM speed -> 16 KB per SM per unit.
//   cost(s)   = waves * steps * mma + reduce; the cheapest s wins, ties go to the smaller s.
// E.g. on 132 SMs, M = 130: qkv (4096 x 1024) -> 2, o_proj (1024 x 2048) -> 8, gate_up (6144 x 1024) -> 1,
// down (1024 x 3072) -> 8, lm_head -> 1.
int choose_split(int tiles, int ksteps, int x_rows, int sms) {
  const double mma = x_rows > 128 ? x_rows / 128.0 : 1.0;
  int best = 1;
  double best_cost = 0;
  for (int s = 1; s <= kSmallMMaxSplit && s <= ksteps; ++s) {
    const double waves = (double)(((int64_t)tiles * s + sms - 1) / sms);
    const double steps = (double)((ksteps + s - 1) / s + 1);
    const double reduce = s > 1 ? (double)s * tiles * x_rows / (32.0 * sms) : 0.0;
    const double cost = waves * steps * mma + reduce;
    if (s == 1 || cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

template <typename T, int MT>
cudaError_t launch_variant(const SmallMGemmArgs& a, const SmallMGemmPlan& plan, float* ws, int* counters,
                           cudaStream_t stream) {
  auto kernel = small_m_gemm_kernel<T, MT>;
  // Above 48 KB of dynamic shared memory a kernel must opt in. Set on every launch (for whichever device is
  // current); a function attribute, not a stream operation, so the launch can still be captured.
  const cudaError_t opt_in = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  smem_bytes(Cfg<MT>::SX, MT));
  if (opt_in != cudaSuccess) return opt_in;
  GemmParams p;
  p.x = a.x;
  p.ldx = a.x_row_stride;
  p.w = a.weight;
  p.bias = a.bias;
  p.y = a.y;
  p.m = a.m;
  p.n = a.n;
  p.k = a.k;
  p.ksteps = a.k / kBK;
  p.split = plan.split_k;
  p.x_rows = plan.x_rows;
  p.ws = ws;
  p.counters = counters;
  return launch_pdl(kernel, dim3(plan.grid_x, plan.grid_y, plan.grid_z), dim3(kThreads), (size_t)plan.smem_bytes,
                    stream, p);
}

template <typename T>
cudaError_t launch_typed(const SmallMGemmArgs& a, const SmallMGemmPlan& plan, float* ws, int* counters,
                         cudaStream_t stream) {
  switch (plan.tile_m) {
    case 64: return launch_variant<T, 64>(a, plan, ws, counters, stream);
    case 128: return launch_variant<T, 128>(a, plan, ws, counters, stream);
    case 256: return launch_variant<T, 256>(a, plan, ws, counters, stream);
    default: return cudaErrorInvalidValue;
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

SmallMGemmPlan plan_small_m_gemm(int m, int n, int k, int num_sms, int64_t num_counters, int tile_m, int split_k) {
  SmallMGemmPlan plan{};
  const int m16 = (m + 15) / 16 * 16;
  // The smallest variant that holds every token in one tile, so each weight byte is read by one CTA only.
  if (tile_m != 64 && tile_m != 128 && tile_m != 256) tile_m = m16 <= 64 ? 64 : m16 <= 128 ? 128 : 256;
  const int x_rows = m16 < tile_m ? m16 : tile_m;
  const int ksteps = k / kBK;
  const int tiles = (n / kBN) * ((m + tile_m - 1) / tile_m);
  int split = split_k > 0 ? split_k : choose_split(tiles, ksteps, x_rows, num_sms > 0 ? num_sms : 1);
  if (split > ksteps) split = ksteps;
  if (split > kSmallMMaxSplit) split = kSmallMMaxSplit;
  if (split < 1) split = 1;
  if (split > 1 && tiles > num_counters) split = 1;  // not enough tile counters: no split-K
  plan.tile_m = tile_m;
  plan.split_k = split;
  plan.grid_x = n / kBN;
  plan.grid_y = (m + tile_m - 1) / tile_m;
  plan.grid_z = split;
  plan.x_rows = x_rows;
  plan.smem_bytes = smem_bytes(num_x_stages(tile_m), x_rows);
  plan.workspace_floats = split > 1 ? (int64_t)tiles * split * tile_m * kBN : 0;
  plan.counters = split > 1 ? tiles : 0;
  return plan;
}

cudaError_t launch_small_m_gemm(const SmallMGemmArgs& a, const SmallMGemmPlan& plan, float* workspace,
                                int* counters, cudaStream_t stream) {
  if (a.m < 1 || a.m > kSmallMMaxM || a.n <= 0 || a.k <= 0 || a.n % kBN != 0 || a.k % kBK != 0)
    return cudaErrorInvalidValue;
  if (!aligned16(a.x) || !aligned16(a.weight) || !aligned16(a.y) || (a.m > 1 && a.x_row_stride % 8 != 0))
    return cudaErrorInvalidValue;
  if (plan.split_k > 1 && (workspace == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
  if (plan.grid_x != a.n / kBN || plan.grid_y != (a.m + plan.tile_m - 1) / plan.tile_m ||
      plan.grid_z != plan.split_k || plan.split_k > a.k / kBK ||
      plan.x_rows < ((a.m + 15) / 16 * 16 < plan.tile_m ? (a.m + 15) / 16 * 16 : plan.tile_m))
    return cudaErrorInvalidValue;  // a plan made for other sizes
  if (a.dtype == GemmDType::kBF16) return launch_typed<__nv_bfloat16>(a, plan, workspace, counters, stream);
  if (a.dtype == GemmDType::kFP16) return launch_typed<__half>(a, plan, workspace, counters, stream);
  return cudaErrorInvalidValue;
}

}  // namespace minillm
