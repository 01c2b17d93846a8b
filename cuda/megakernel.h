// Plain C++ launcher of the persistent decode kernel ("megakernel", decode_megakernel.cu): every decoder layer of
// one decode step (one new token for each of up to kMegaMaxBatch sequences) in a single cooperative launch.
// No torch types: cuda/megakernel_bindings.cpp turns tensors into this struct.
//
// Weight layout ("granule" order, built once by minillm/ops/megakernel.py): a linear weight [N, K] is cut into
// granules of 8 rows; a granule is stored as K/32 blocks of 512 bytes, block p holding for lane l = 4r + q the
// 8 elements W[8g + r][32p + 8t + 2q + e] (t < 4, e < 2) in the order (t, e): exactly the B operand of two
// mma.sync m16n8k16 k-steps, so a lane reads its fragments with one 16-byte shared-memory load and the rows a
// CTA owns form one contiguous range (one bulk copy). gate_up interleaves gate granule j and up granule j.
// Layers are stacked: layer l of a matrix starts at l * rows * K elements.
//
// Activation ("row fragment") layout of the global buffers attn_frag [16 * Hq D] and h_frag [16 * I] (width K):
// element (m, k) at (((m * K / 32 + k / 32) * 4 + (k % 8) / 2) * 4 + (k % 32 >= 16) * 2 + (k % 16 >= 8)) * 2 + k % 2.
// Row m is contiguous (only the live rows are written and read); within it, the 16 bytes at (k / 32, q) are the A
// registers a0/a2 (or a1/a3 for rows 8..15) of mma lane quad position q for both k-steps of the k-pair k / 32.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace minillm {

constexpr int kMegaMaxLayers = 64;
constexpr int kMegaMaxBatch = 16;       // batch rows are the 16 rows of one mma A tile
constexpr int kMegaThreads = 256;       // 8 warps, one CTA per SM
constexpr int kMegaGranuleRows = 8;
constexpr int kMegaMaxGranules = 8;     // granules (gate and up count one each) a CTA may own in one phase
constexpr int kMegaMaxHidden = 2048;    // a norm row is held in registers (8 x 16 bytes per lane)
constexpr int kMegaMaxPartitions = 256; // attention partitions of one sequence (bounded by the grid anyway)
// Timeline stamps (MegakernelParams::prof): per layer and CTA, thread 0 records (clock64, %globaltimer) at these
// points, in phase order: QKV start, weights (and ln1) landed, norm done, GEMV done, arrive; attention start,
// arrive; O start, weights landed, GEMV done, arrive; GU start, weights (and ln2) landed, norm done, GEMV done,
// arrive; DOWN start,
// weights landed, GEMV done, arrive. One more pair per CTA after the last layer (final norm done).
// minillm/bench/megakernel_timeline.py names them and turns them into per-phase costs.
constexpr int kMegaProfPoints = 20;

struct MegakernelParams {
  // ---- step inputs ----
  const int64_t* input_ids;     // [batch]
  const int64_t* positions;     // [batch]
  const int64_t* slot_mapping;  // [batch]: cache slot of the new token, -1 = padded row (nothing written)
  const int* seq_lens;          // [batch]: context length including the new token
  const int* block_tables;      // [batch, bt_stride] physical block ids
  int64_t bt_stride;
  int batch;
  // ---- model ----
  int num_layers, hidden, inter, num_heads, num_kv_heads, head_dim, block_size;
  float eps, scale;
  int64_t max_positions;
  const void* embed;       // [vocab_size, hidden]
  int64_t vocab_size;      // an input id outside [0, vocab_size) gives a NaN row
  const void* w_qkv;       // granule order, [L][(Hq + 2 Hkv) D][hidden]
  const void* w_o;         // [L][hidden][Hq D]
  const void* w_gu;        // [L][2 inter][hidden], gate/up granules interleaved
  const void* w_down;      // [L][hidden][inter]
  const void* b_qkv;       // [L][(Hq + 2 Hkv) D] or null (Qwen3)
  const void* ln1;         // [L][hidden] input_layernorm
  const void* ln2;         // [L][hidden] post_attention_layernorm
  const void* q_norm;      // [L][D] or null (Qwen2), together with k_norm
  const void* k_norm;
  const void* final_norm;  // [hidden]
  const float* cos_sin;    // [max_positions, D]: cos | sin
  void* k_cache[kMegaMaxLayers];  // [num_blocks, block_size, Hkv, D] each, contiguous
  void* v_cache[kMegaMaxLayers];
  // ---- workspaces (caller-owned, see megakernel_workspace_* below) ----
  void* qkv;          // [kMegaMaxBatch, (Hq + 2 Hkv) D] row-major
  void* attn_frag;    // [16 * Hq D] row-fragment order
  void* h_frag;       // [16 * inter] row-fragment order
  void* resid;        // [kMegaMaxBatch, hidden]: the residual stream
  void* out;          // [batch, hidden]: final-normed hidden states
  float* partials;    // [num_ctas, group, D + 2]
  unsigned* sync;     // [megakernel_sync_words]: zeroed by the launcher before every launch
  // ---- launch ----
  int num_ctas;              // grid size: at most one CTA per SM
  int min_partition_chunks;  // attention partitions hold at least this many 16-token chunks
  int cooperative;           // 1: cooperative launch (co-residency guaranteed); 0: plain launch
  ScalarType dtype;          // kBFloat16 or kFloat16
  // [(num_layers * kMegaProfPoints + 1) * num_ctas * 2] timeline stamps, or null (the default: no stamps)
  unsigned long long* prof;
  // With prof: kMegaProfSerialWeights issues every weight slice just before it is waited for instead of a phase
  // ahead (a diagnosis: the steps' costs with no weight stream in flight).
  int prof_flags;
};

// 64-bit words of the timeline buffer of a launch.
constexpr int kMegaProfSerialWeights = 1;

inline int64_t megakernel_prof_words(int num_layers, int num_ctas) {
  return ((int64_t)num_layers * kMegaProfPoints + 1) * num_ctas * 2;
}

// Byte sizes of the shared-memory regions (see decode_megakernel.cu); minillm/ops/megakernel.py mirrors this.
struct MegakernelSmemPlan {
  int w0, w1, uni, qtile, misc, nw, total;  // nw: the norm weight that rides with each QKV / GU slice
};

// Words of the sync buffer: barrier counter, then one merge ticket per (row, KV head).
inline int megakernel_sync_words(int num_kv_heads) { return 4 + kMegaMaxBatch * num_kv_heads; }

// Fills *plan; returns cudaErrorInvalidValue when a shape is outside the kernel's limits.
cudaError_t megakernel_smem_plan(const MegakernelParams& p, MegakernelSmemPlan* plan);

// Zeroes the sync buffer and launches the kernel on `stream` (both capturable in a CUDA graph). Returns
// cudaErrorNotSupported on GPUs older than sm_90, cudaErrorInvalidValue for unsupported shapes or a plan that
// does not fit shared memory, or the launch error.
cudaError_t launch_decode_megakernel(const MegakernelParams& p, cudaStream_t stream);

}  // namespace minillm
