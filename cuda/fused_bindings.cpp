// Torch bindings of the fused elementwise kernels, the one-pass sampler (launchers in fused.h) and the skinny
// GEMM (gemm.h).
//
// Each op checks its tensors (bad input raises ValueError naming the argument), allocates fresh outputs,
// and launches on the current stream. Only qk_norm_rope_cache writes into inputs (the KV caches), which its
// schema declares with (a!)/(b!) so that CUDA graphs and torch.compile see the writes.
// Meta implementations give torch.compile the output shapes without running anything.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "bindings_util.h"
#include "fused.h"
#include "gemm.h"
#include "prefetch.h"

namespace {

using at::Tensor;
using minillm::bindings::msg;
using minillm::ScalarType;


ScalarType act_dtype(const Tensor& t, const char* name) {
  const at::ScalarType s = t.scalar_type();
  MINILLM_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, name,
                    ": dtype must be float32, float16 or bfloat16, got ", s);
  return s == at::kFloat ? ScalarType::kFloat32 : s == at::kHalf ? ScalarType::kFloat16 : ScalarType::kBFloat16;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, msg("minillm.", op, ": CUDA error ", cudaGetErrorString(err)));
}

void check_like(const Tensor& t, const Tensor& ref, const char* name, const char* ref_name) {
  MINILLM_CHECK(t.is_cuda() && t.device() == ref.device(), name, " must be on ", ref_name, "'s device ",
                    ref.device(), ", got ", t.device());
  MINILLM_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have ", ref_name, "'s dtype ",
                    ref.scalar_type(), ", got ", t.scalar_type());
}

// x as [rows, hidden] with a unit last stride (a view when the leading dims allow one, else a copy).
Tensor as_rows(const Tensor& x, const char* name) {
  MINILLM_CHECK(x.is_cuda(), name, " must be a CUDA tensor");
  MINILLM_CHECK(x.dim() >= 1 && x.size(-1) > 0, name, " must have a non-empty last dim, got shape ", x.sizes());
  const Tensor y = x.stride(-1) == 1 ? x : x.contiguous();
  return y.reshape({-1, y.size(-1)});
}

void check_weight(const Tensor& w, const Tensor& x, const char* name, int64_t size) {
  check_like(w, x, name, "the activation");
  MINILLM_CHECK(w.dim() == 1 && w.size(0) == size && w.is_contiguous(), name, " must be contiguous [", size,
                    "], got shape ", w.sizes());
}

void check_hidden(int64_t hidden, const char* name) {
  MINILLM_CHECK(hidden <= minillm::kMaxNormHidden, name, ": last dim must be in [1, ", minillm::kMaxNormHidden,
                    "], got ", hidden);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const ScalarType dtype = act_dtype(x, "x");
  const Tensor x2 = as_rows(x, "x");
  const int64_t hidden = x2.size(1);
  check_hidden(hidden, "x");
  check_weight(weight, x, "weight", hidden);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty(x.sizes(), x.options());
  check_launch(minillm::launch_rms_norm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), y.data_ptr(), x2.size(0),
                                       hidden, static_cast<float>(eps), dtype,
                                       at::cuda::getCurrentCUDAStream()),
               "rms_norm");
  return y;
}

std::tuple<Tensor, Tensor> fused_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                              double eps) {
  MINILLM_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ",
                    residual.sizes());
  check_like(residual, x, "residual", "x");
  const ScalarType dtype = act_dtype(x, "x");
  const Tensor x2 = as_rows(x, "x"), r2 = as_rows(residual, "residual");
  const int64_t hidden = x2.size(1);
  check_hidden(hidden, "x");
  check_weight(weight, x, "weight", hidden);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options();
  Tensor y = at::empty(x.sizes(), opts), sum = at::empty(x.sizes(), opts);
  check_launch(minillm::launch_fused_add_rms_norm(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0),
                                                  weight.data_ptr(), y.data_ptr(), sum.data_ptr(), x2.size(0), hidden,
                                                  static_cast<float>(eps), dtype, at::cuda::getCurrentCUDAStream()),
               "fused_add_rms_norm");
  return {y, sum};
}

Tensor silu_and_mul(const Tensor& gate_up) {
  const ScalarType dtype = act_dtype(gate_up, "gate_up");
  const Tensor g2 = as_rows(gate_up, "gate_up");
  MINILLM_CHECK(g2.size(1) % 2 == 0, "gate_up: last dim must be even (gate | up), got ", g2.size(1));
  const int64_t inter = g2.size(1) / 2;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  Tensor out = at::empty(sizes, gate_up.options());
  check_launch(minillm::launch_silu_and_mul(g2.data_ptr(), g2.stride(0), out.data_ptr(), g2.size(0), inter,
                                            dtype, at::cuda::getCurrentCUDAStream()),
               "silu_and_mul");
  return out;
}

void check_heads(const Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  MINILLM_CHECK(num_heads >= 1 && num_heads <= 65536, "num_heads must be in [1, 65536], got ", num_heads);
  MINILLM_CHECK(num_kv_heads >= 1 && num_kv_heads <= 65536, "num_kv_heads must be in [1, 65536], got ",
                    num_kv_heads);
  MINILLM_CHECK(head_dim >= 2 && head_dim <= minillm::kMaxHeadDim && head_dim % 2 == 0,
                    "head_dim must be even and in [2, ", minillm::kMaxHeadDim, "], got ", head_dim);
  MINILLM_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
                    "qkv must be [tokens, (num_heads + 2 * num_kv_heads) * head_dim] = [T, ",
                    (num_heads + 2 * num_kv_heads) * head_dim, "], got shape ", qkv.sizes());
}

void check_norm_weights(const std::optional<Tensor>& qw, const std::optional<Tensor>& kw, const Tensor& qkv,
                        int64_t head_dim) {
  MINILLM_CHECK(qw.has_value() == kw.has_value(),
                    "q_norm_weight and k_norm_weight must be given together (Qwen3) or both None (Qwen2)");
  if (!qw.has_value()) return;
  check_weight(*qw, qkv, "q_norm_weight", head_dim);
  check_weight(*kw, qkv, "k_norm_weight", head_dim);
}

// The checked inputs of both qk_norm_rope ops. It holds the tensors the launcher arguments point into (qkv with
// a unit last stride, int64 positions; possibly fresh copies), so that they outlive the launch.
struct RopeInputs {
  Tensor qkv;
  Tensor positions;
  ScalarType dtype;
};

RopeInputs check_rope_inputs(const Tensor& qkv_in, const Tensor& positions_in, const Tensor& cos_sin_cache,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             const std::optional<Tensor>& q_norm_weight, const std::optional<Tensor>& k_norm_weight) {
  MINILLM_CHECK(qkv_in.is_cuda(), "qkv must be a CUDA tensor");
  const ScalarType dtype = act_dtype(qkv_in, "qkv");
  check_heads(qkv_in, num_heads, num_kv_heads, head_dim);
  const Tensor qkv = qkv_in.stride(1) == 1 ? qkv_in : qkv_in.contiguous();
  const int64_t tokens = qkv.size(0);
  check_norm_weights(q_norm_weight, k_norm_weight, qkv, head_dim);
  MINILLM_CHECK(positions_in.dim() == 1 && positions_in.size(0) == tokens && positions_in.is_cuda() &&
                        !at::isFloatingType(positions_in.scalar_type()),
                    "positions must be an integer CUDA tensor [", tokens, "], got ", positions_in.sizes(), " ",
                    positions_in.scalar_type());
  MINILLM_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                        cos_sin_cache.size(1) == head_dim && cos_sin_cache.is_contiguous() &&
                        cos_sin_cache.device() == qkv.device(),
                    "cos_sin_cache must be contiguous float32 [max_positions, ", head_dim, "] on qkv's device, got ",
                    cos_sin_cache.sizes(), " ", cos_sin_cache.scalar_type());
  return {qkv, positions_in.to(at::kLong).contiguous(), dtype};
}

// Launcher arguments with q as the q output and no k/v destination yet (the caller sets k/v or the caches).
minillm::QkNormRopeArgs rope_args(const RopeInputs& in, const Tensor& cos_sin_cache, Tensor& q,
                                  const std::optional<Tensor>& q_norm_weight,
                                  const std::optional<Tensor>& k_norm_weight, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, double eps) {
  minillm::QkNormRopeArgs a{};
  a.qkv = in.qkv.data_ptr();
  a.qkv_row_stride = in.qkv.stride(0);
  a.positions = in.positions.data_ptr<int64_t>();
  a.cos_sin = cos_sin_cache.data_ptr<float>();
  a.max_positions = cos_sin_cache.size(0);
  a.q_norm_weight = q_norm_weight ? q_norm_weight->data_ptr() : nullptr;
  a.k_norm_weight = k_norm_weight ? k_norm_weight->data_ptr() : nullptr;
  a.q = q.data_ptr();
  a.num_tokens = in.qkv.size(0);
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_dim = static_cast<int>(head_dim);
  a.eps = static_cast<float>(eps);
  return a;
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope(const Tensor& qkv_in, const Tensor& positions_in,
                                                const Tensor& cos_sin_cache, int64_t num_heads, int64_t num_kv_heads,
                                                int64_t head_dim, const std::optional<Tensor>& q_norm_weight,
                                                const std::optional<Tensor>& k_norm_weight, double eps) {
  const RopeInputs in = check_rope_inputs(qkv_in, positions_in, cos_sin_cache, num_heads, num_kv_heads, head_dim,
                                          q_norm_weight, k_norm_weight);
  const c10::cuda::CUDAGuard guard(in.qkv.device());
  const int64_t tokens = in.qkv.size(0);
  const auto opts = in.qkv.options();
  Tensor q = at::empty({tokens, num_heads, head_dim}, opts);
  Tensor k = at::empty({tokens, num_kv_heads, head_dim}, opts);
  Tensor v = at::empty({tokens, num_kv_heads, head_dim}, opts);
  minillm::QkNormRopeArgs a =
      rope_args(in, cos_sin_cache, q, q_norm_weight, k_norm_weight, num_heads, num_kv_heads, head_dim, eps);
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  check_launch(minillm::launch_qk_norm_rope(a, in.dtype, at::cuda::getCurrentCUDAStream()), "qk_norm_rope");
  return {q, k, v};
}

// A paged KV cache the fused write can store into: qkv's device and dtype, contiguous
// [num_blocks, block_size, num_kv_heads, head_dim].
void check_kv_cache(const Tensor& cache, const Tensor& qkv, const char* name, int64_t num_kv_heads,
                    int64_t head_dim) {
  check_like(cache, qkv, name, "qkv");
  MINILLM_CHECK(cache.dim() == 4 && cache.size(2) == num_kv_heads && cache.size(3) == head_dim, name,
              " must be [num_blocks, block_size, num_kv_heads, head_dim] = [N, B, ", num_kv_heads, ", ", head_dim,
              "], got shape ", cache.sizes());
  MINILLM_CHECK(cache.is_contiguous(), name, " must be contiguous (slots are addressed as flat rows)");
}

// qk_norm_rope with the KV-cache write fused in: k and v rows go to their slots of k_cache / v_cache (slot -1:
// not stored) instead of to fresh tensors. Returns q only. k_scale / v_scale given: the caches are fp8
// (float8_e4m3fn / float8_e5m2) and the rows are quantized with those fp32 [num_kv_heads] scales.
Tensor rope_into_cache(const Tensor& qkv_in, const Tensor& positions_in, const Tensor& cos_sin_cache,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       const std::optional<Tensor>& q_norm_weight, const std::optional<Tensor>& k_norm_weight,
                       double eps, Tensor& k_cache, Tensor& v_cache, const Tensor& slot_mapping,
                       const Tensor* k_scale, const Tensor* v_scale) {
  const RopeInputs in = check_rope_inputs(qkv_in, positions_in, cos_sin_cache, num_heads, num_kv_heads, head_dim,
                                          q_norm_weight, k_norm_weight);
  const int64_t tokens = in.qkv.size(0);
  if (k_scale == nullptr) {
    check_kv_cache(k_cache, in.qkv, "k_cache", num_kv_heads, head_dim);
    check_kv_cache(v_cache, in.qkv, "v_cache", num_kv_heads, head_dim);
  } else {
    for (const Tensor* c : {&k_cache, &v_cache}) {
      MINILLM_CHECK(c->is_cuda() && c->device() == in.qkv.device(), "fp8 caches must be on qkv's device");
      MINILLM_CHECK(c->scalar_type() == at::kFloat8_e4m3fn || c->scalar_type() == at::kFloat8_e5m2,
                    "fp8 caches must be float8_e4m3fn or float8_e5m2, got ", c->scalar_type());
      MINILLM_CHECK(c->dim() == 4 && c->size(2) == num_kv_heads && c->size(3) == head_dim && c->is_contiguous(),
                    "fp8 caches must be contiguous [num_blocks, block_size, ", num_kv_heads, ", ", head_dim, "]");
    }
    MINILLM_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache dtypes differ");
    for (const Tensor* t : {k_scale, v_scale})
      MINILLM_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == num_kv_heads &&
                        t->is_contiguous() && t->device() == in.qkv.device(),
                    "k_scale / v_scale must be contiguous float32 [num_kv_heads] on qkv's device");
  }
  MINILLM_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
              v_cache.sizes());
  MINILLM_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.device() == in.qkv.device(),
              "slot_mapping must be contiguous int64 [>= tokens] on qkv's device, got ", slot_mapping.sizes(), " ",
              slot_mapping.scalar_type(), " on ", slot_mapping.device());
  MINILLM_CHECK(slot_mapping.size(0) >= tokens, "slot_mapping must have at least one slot per token (", tokens,
              "), got ", slot_mapping.size(0));
  const c10::cuda::CUDAGuard guard(in.qkv.device());
  Tensor q = at::empty({tokens, num_heads, head_dim}, in.qkv.options());
  minillm::QkNormRopeArgs a =
      rope_args(in, cos_sin_cache, q, q_norm_weight, k_norm_weight, num_heads, num_kv_heads, head_dim, eps);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  if (k_scale != nullptr) {
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
    a.cache_dtype = k_cache.scalar_type() == at::kFloat8_e5m2 ? minillm::ScalarType::kFloat8E5M2
                                                               : minillm::ScalarType::kFloat8E4M3;
  }
  check_launch(minillm::launch_qk_norm_rope(a, in.dtype, at::cuda::getCurrentCUDAStream()), "qk_norm_rope_cache");
  return q;
}

Tensor qk_norm_rope_cache(const Tensor& qkv, const Tensor& positions, const Tensor& cos_sin_cache,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          const std::optional<Tensor>& q_norm_weight, const std::optional<Tensor>& k_norm_weight,
                          double eps, Tensor& k_cache, Tensor& v_cache, const Tensor& slot_mapping) {
  return rope_into_cache(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_norm_weight,
                         k_norm_weight, eps, k_cache, v_cache, slot_mapping, nullptr, nullptr);
}

Tensor qk_norm_rope_cache_fp8(const Tensor& qkv, const Tensor& positions, const Tensor& cos_sin_cache,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              const std::optional<Tensor>& q_norm_weight, const std::optional<Tensor>& k_norm_weight,
                              double eps, Tensor& k_cache, Tensor& v_cache, const Tensor& slot_mapping,
                              const Tensor& k_scale, const Tensor& v_scale) {
  return rope_into_cache(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_norm_weight,
                         k_norm_weight, eps, k_cache, v_cache, slot_mapping, &k_scale, &v_scale);
}

// An optional per-row parameter of an op on logits [N, V]: null when absent, else its data, checked to be
// contiguous `dtype` [N] on logits' device.
const void* optional_row_param(const std::optional<Tensor>& t, const Tensor& logits, at::ScalarType dtype,
                               const char* name) {
  if (!t.has_value()) return nullptr;
  MINILLM_CHECK(t->scalar_type() == dtype && t->dim() == 1 && t->size(0) == logits.size(0) && t->is_contiguous() &&
                    t->device() == logits.device(),
                name, " must be contiguous ", dtype, " [", logits.size(0), "] on logits' device, got ", t->sizes(),
                " ", t->scalar_type(), " on ", t->device());
  return t->data_ptr();
}

// splits: CTAs per row, 0 = the launcher's choice; the thresholds are the same for every value, which the tests use.
// Device scratch of the sampler's split rows (partial results and tickets; none when a CTA covers each row).
// Fresh from the caching allocator on every call rather than a persistent per-device buffer: under CUDA graph
// capture it comes from the graph's private pool, so the captured launch and every replay own the same block,
// and concurrent streams never share one. The launcher zeroes the tickets on the stream before its kernel (a
// memset node when captured), so a recycled block's old contents never matter.
Tensor race_workspace(const Tensor& logits, int64_t rows, int splits) {
  const int64_t bytes = minillm::sample_exponential_race_workspace_bytes(rows, splits);
  return bytes > 0 ? at::empty({bytes}, logits.options().dtype(at::kByte)) : Tensor();
}

// logits: float32, float16 or bfloat16 (the lm_head output as it is); the kernel widens each value to fp32.
// The sampler's grammar bitmask arguments, checked (sample_exponential_race below).
void race_bitmask(minillm::RaceFilter& f, const std::optional<Tensor>& bitmask, const std::optional<Tensor>& rows,
                  const Tensor& logits) {
  MINILLM_CHECK(!rows.has_value() || bitmask.has_value(), "mask_rows needs a bitmask");
  if (!bitmask.has_value()) return;
  MINILLM_CHECK(f.threshold == nullptr, "a bitmask and a threshold cannot be given together");
  const Tensor& b = *bitmask;
  const int64_t words = (logits.size(1) + 31) / 32;
  MINILLM_CHECK(b.scalar_type() == at::kInt && b.dim() == 2 && b.size(1) >= words && b.stride(1) == 1 &&
                    b.device() == logits.device(),
                "bitmask must be int32 [M, >= ", words, "] with unit column stride on logits' device, got ",
                b.sizes(), " ", b.scalar_type(), " on ", b.device());
  if (rows.has_value()) {
    MINILLM_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->size(0) == b.size(0) &&
                      rows->is_contiguous() && rows->device() == logits.device(),
                  "mask_rows must be contiguous int64 [", b.size(0), "] on logits' device, got ", rows->sizes(), " ",
                  rows->scalar_type());
    f.mask_rows = rows->data_ptr<int64_t>();
  } else {
    MINILLM_CHECK(b.size(0) == logits.size(0), "a bitmask without mask_rows needs a row per logits row (",
                  logits.size(0), "), got ", b.size(0));
  }
  f.bitmask = b.data_ptr<int32_t>();
  f.words = b.stride(0);
  f.num_mask_rows = static_cast<int>(b.size(0));
}

// splits: CTAs per row, 0 = the launcher's choice (several per row only when rows are few); the tokens are the
// same for every value, which the tests use to check the split rows against one CTA per row.
// bitmask: optional int32 [M, ceil(V / 32)], the grammar bitmask of M rows (a clear bit: that column cannot be
// drawn), with mask_rows int64 [M] naming them in ascending order, or without it M = N, every row in order. Not
// with a threshold (the threshold would have to be computed on the masked logits).
Tensor sample_exponential_race(const Tensor& logits_in, const Tensor& inv_temperature, int64_t seed, int64_t offset,
                               int64_t splits, const std::optional<Tensor>& threshold,
                               const std::optional<Tensor>& bitmask, const std::optional<Tensor>& mask_rows) {
  MINILLM_CHECK(logits_in.is_cuda() && logits_in.dim() == 2, "logits must be a CUDA tensor [N, V], got ",
                    logits_in.sizes(), " on ", logits_in.device());
  const ScalarType dtype = act_dtype(logits_in, "logits");
  const Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  MINILLM_CHECK(vocab >= 1 && vocab <= minillm::kMaxVocab - 4, "logits: vocab size must be in [1, ",
                    minillm::kMaxVocab - 4, "], got ", vocab);
  MINILLM_CHECK(inv_temperature.scalar_type() == at::kFloat && inv_temperature.dim() == 1 &&
                        inv_temperature.size(0) == rows && inv_temperature.is_contiguous() &&
                        inv_temperature.device() == logits.device(),
                    "inv_temperature must be contiguous float32 [", rows, "] on logits' device, got ",
                    inv_temperature.sizes(), " ", inv_temperature.scalar_type());
  MINILLM_CHECK(seed >= 0, "seed must be in [0, 2**63), got ", seed);
  MINILLM_CHECK(offset >= 0, "offset must be in [0, 2**63), got ", offset);
  MINILLM_CHECK(splits >= 0 && splits <= minillm::kMaxRaceSplits, "splits must be 0 (automatic) or in [1, ",
                    minillm::kMaxRaceSplits, "], got ", splits);
  minillm::RaceFilter filter;
  filter.threshold = static_cast<const float*>(optional_row_param(threshold, logits, at::kFloat, "threshold"));
  race_bitmask(filter, bitmask, mask_rows, logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const int ctas = minillm::sample_exponential_race_splits(rows, vocab, splits);
  const Tensor workspace = race_workspace(logits, rows, ctas);
  check_launch(minillm::launch_sample_exponential_race(
                   logits.data_ptr(), logits.stride(0), inv_temperature.data_ptr<float>(), filter, out.data_ptr<int64_t>(),
                   rows, vocab, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), ctas,
                   workspace.defined() ? workspace.data_ptr() : nullptr, dtype, at::cuda::getCurrentCUDAStream()),
               "sample_exponential_race");
  return out;
}

// Seeded rows' noise into noise [N, V] (float32, in place): args int64 [3, M] = (row, seed bits, output
// position) per seeded row, on noise's device; offset is added to every position (launcher in fused.h).
void seeded_exponential_(Tensor& noise, const Tensor& args, int64_t offset) {
  MINILLM_CHECK(noise.is_cuda() && noise.dim() == 2 && noise.scalar_type() == at::kFloat && noise.stride(1) == 1,
                "noise must be a float32 CUDA tensor [N, V] with unit column stride, got ", noise.sizes(), " ",
                noise.scalar_type(), " on ", noise.device());
  MINILLM_CHECK(args.scalar_type() == at::kLong && args.dim() == 2 && args.size(0) == 3 && args.is_contiguous() &&
                    args.device() == noise.device(),
                "args must be contiguous int64 [3, M] on noise's device, got ", args.sizes(), " ",
                args.scalar_type(), " on ", args.device());
  MINILLM_CHECK(args.size(1) <= 65535, "args: at most 65535 seeded rows, got ", args.size(1));
  MINILLM_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  MINILLM_CHECK(noise.size(1) >= 1 && noise.size(1) <= minillm::kMaxVocab - 4, "noise: vocab size must be in [1, ",
                minillm::kMaxVocab - 4, "], got ", noise.size(1));
  const c10::cuda::CUDAGuard guard(noise.device());
  check_launch(minillm::launch_seeded_exponential(noise.data_ptr<float>(), noise.stride(0), noise.size(0),
                                                  noise.size(1), args.data_ptr<int64_t>(), args.size(1),
                                                  static_cast<uint64_t>(offset), at::cuda::getCurrentCUDAStream()),
               "seeded_exponential_");
}

Tensor truncation_threshold(const Tensor& logits_in, const std::optional<Tensor>& top_k,
                            const std::optional<Tensor>& top_p, const std::optional<Tensor>& log_min_p,
                            int64_t splits) {
  MINILLM_CHECK(logits_in.is_cuda() && logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat,
                "logits must be a float32 CUDA tensor [N, V], got ", logits_in.sizes(), " ", logits_in.scalar_type(),
                " on ", logits_in.device());
  const Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  MINILLM_CHECK(vocab >= 1 && vocab <= minillm::kMaxThresholdVocab, "logits: vocab size must be in [1, ",
                minillm::kMaxThresholdVocab, "], got ", vocab);
  const auto* k = static_cast<const int64_t*>(optional_row_param(top_k, logits, at::kLong, "top_k"));
  const auto* p = static_cast<const float*>(optional_row_param(top_p, logits, at::kFloat, "top_p"));
  const auto* m = static_cast<const float*>(optional_row_param(log_min_p, logits, at::kFloat, "log_min_p"));
  MINILLM_CHECK(splits >= 0 && splits <= 8, "splits must be 0 (automatic) or in [1, 8], got ", splits);
  MINILLM_CHECK(rows <= INT32_MAX / 8, "logits: at most ", INT32_MAX / 8, " rows, got ", rows);
  const c10::cuda::CUDAGuard guard(logits.device());
  Tensor out = at::empty({rows}, logits.options());
  check_launch(minillm::launch_truncation_threshold(logits.data_ptr<float>(), logits.stride(0), rows, vocab, k, p, m,
                                                    out.data_ptr<float>(), splits, at::cuda::getCurrentCUDAStream()),
               "truncation_threshold");
  return out;
}

// x [M, K] times w [N, K]^T -> [M, N] (a decode-sized linear layer, no bias); launcher in gemm.h.
Tensor skinny_gemm(const Tensor& x_in, const Tensor& w, int64_t splits) {
  MINILLM_CHECK(x_in.is_cuda() && x_in.dim() == 2, "x must be a CUDA tensor [M, K], got ", x_in.sizes(), " on ",
              x_in.device());
  check_like(w, x_in, "w", "x");
  const ScalarType dtype = act_dtype(x_in, "x");
  MINILLM_CHECK(dtype != ScalarType::kFloat32, "x: dtype must be float16 or bfloat16, got ", x_in.scalar_type());
  // 16-byte copies: rows must start 16-byte aligned, else a contiguous copy is made.
  const bool aligned = reinterpret_cast<uintptr_t>(x_in.data_ptr()) % 16 == 0 && x_in.stride(0) % 8 == 0;
  const Tensor x = x_in.stride(1) == 1 && aligned ? x_in : x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  MINILLM_CHECK(w.dim() == 2 && w.size(1) == k && w.is_contiguous(), "w must be contiguous [N, ", k, "], got ",
              w.sizes());
  MINILLM_CHECK(splits == 1 || splits == 2 || splits == 4 || splits == 8, "splits must be 1, 2, 4 or 8, got ",
              splits);
  MINILLM_CHECK(n % minillm::kGemmTileN == 0, "w: N must be a multiple of ", int64_t(minillm::kGemmTileN), ", got ",
              n);
  MINILLM_CHECK(k % (splits * minillm::kGemmTileK) == 0, "K must be a multiple of splits * ",
              int64_t(minillm::kGemmTileK), ", got K=", k, ", splits=", splits);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty({m, n}, x.options());
  check_launch(minillm::launch_skinny_gemm(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(),
                                           y.stride(0), int(m), int(n), int(k), int(splits), dtype,
                                           at::cuda::getCurrentCUDAStream()),
               "skinny_gemm");
  return y;
}

// Ask L2 for the bytes of `tensors` (contiguous, on one GPU) ahead of the kernel that reads them. Issues the
// requests and returns; the result of every later kernel is unchanged.
void l2_prefetch(at::TensorList tensors) {
  MINILLM_CHECK(int64_t(tensors.size()) <= minillm::kMaxPrefetchTensors, "l2_prefetch takes at most ",
                int64_t(minillm::kMaxPrefetchTensors), " tensors, got ", int64_t(tensors.size()));
  if (tensors.empty()) return;
  minillm::L2PrefetchList list{};
  for (const Tensor& t : tensors) {
    MINILLM_CHECK(t.is_cuda() && t.device() == tensors[0].device() && t.is_contiguous(),
                  "l2_prefetch: tensors must be contiguous and on one CUDA device, got ", t.sizes(), " on ",
                  t.device());
    list.ptr[list.count] = static_cast<const char*>(t.data_ptr());
    list.bytes[list.count] = int64_t(t.numel()) * t.element_size();
    ++list.count;
  }
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  check_launch(minillm::launch_l2_prefetch(list, sms, at::cuda::getCurrentCUDAStream()), "l2_prefetch");
}

// Whether this thread's later launches of minillm's kernels use programmatic dependent launch (launch.h);
// returns the previous setting. minillm/ops/launch.py wraps it.
bool set_pdl_launches(bool on) { return minillm::set_pdl_launches(on); }

// Shape-only twins for torch.compile's fake tensors.
Tensor rms_norm_meta(const Tensor& x, const Tensor&, double) { return at::empty(x.sizes(), x.options()); }

std::tuple<Tensor, Tensor> fused_add_rms_norm_meta(const Tensor& x, const Tensor&, const Tensor&, double) {
  return {at::empty(x.sizes(), x.options()), at::empty(x.sizes(), x.options())};
}

Tensor silu_and_mul_meta(const Tensor& gate_up) {
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  return at::empty(sizes, gate_up.options());
}

std::tuple<Tensor, Tensor, Tensor> qk_norm_rope_meta(const Tensor& qkv, const Tensor&, const Tensor&,
                                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                                     const std::optional<Tensor>&, const std::optional<Tensor>&,
                                                     double) {
  const int64_t t = qkv.size(0);
  return {at::empty({t, num_heads, head_dim}, qkv.options()), at::empty({t, num_kv_heads, head_dim}, qkv.options()),
          at::empty({t, num_kv_heads, head_dim}, qkv.options())};
}

Tensor qk_norm_rope_cache_meta(const Tensor& qkv, const Tensor&, const Tensor&, int64_t num_heads, int64_t,
                               int64_t head_dim, const std::optional<Tensor>&, const std::optional<Tensor>&, double,
                               Tensor&, Tensor&, const Tensor&) {
  return at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
}

Tensor qk_norm_rope_cache_fp8_meta(const Tensor& qkv, const Tensor&, const Tensor&, int64_t num_heads, int64_t,
                                   int64_t head_dim, const std::optional<Tensor>&, const std::optional<Tensor>&,
                                   double, Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  return at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
}

Tensor sample_exponential_race_meta(const Tensor& logits, const Tensor&, int64_t, int64_t, int64_t,
                                    const std::optional<Tensor>&, const std::optional<Tensor>&,
                                    const std::optional<Tensor>&) {
  return at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
}

void seeded_exponential_meta(Tensor&, const Tensor&, int64_t) {}

Tensor truncation_threshold_meta(const Tensor& logits, const std::optional<Tensor>&, const std::optional<Tensor>&,
                                 const std::optional<Tensor>&, int64_t) {
  return at::empty({logits.size(0)}, logits.options());
}

Tensor skinny_gemm_meta(const Tensor& x, const Tensor& w, int64_t) {
  return at::empty({x.size(0), w.size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("qk_norm_rope(Tensor qkv, Tensor positions, Tensor cos_sin_cache, int num_heads, int num_kv_heads, "
        "int head_dim, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_rope_cache(Tensor qkv, Tensor positions, Tensor cos_sin_cache, int num_heads, int num_kv_heads, "
        "int head_dim, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def("qk_norm_rope_cache_fp8(Tensor qkv, Tensor positions, Tensor cos_sin_cache, int num_heads, "
        "int num_kv_heads, int head_dim, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor k_scale, Tensor v_scale) -> Tensor");
  m.def("sample_exponential_race(Tensor logits, Tensor inv_temperature, int seed, int offset, int splits=0, "
        "Tensor? threshold=None, Tensor? bitmask=None, Tensor? mask_rows=None) -> Tensor");
  m.def("seeded_exponential_(Tensor(a!) noise, Tensor args, int offset=0) -> ()");
  m.def("truncation_threshold(Tensor logits, Tensor? top_k, Tensor? top_p, Tensor? log_min_p, int splits=0) -> Tensor");
  m.def("skinny_gemm(Tensor x, Tensor w, int splits) -> Tensor");
  m.def("l2_prefetch(Tensor[] tensors) -> ()");
  m.def("set_pdl_launches(bool on) -> bool", &set_pdl_launches);  // no tensor: one kernel for every backend
}

TORCH_LIBRARY_IMPL(minillm, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("qk_norm_rope_cache", &qk_norm_rope_cache);
  m.impl("qk_norm_rope_cache_fp8", &qk_norm_rope_cache_fp8);
  m.impl("sample_exponential_race", &sample_exponential_race);
  m.impl("seeded_exponential_", &seeded_exponential_);
  m.impl("truncation_threshold", &truncation_threshold);
  m.impl("skinny_gemm", &skinny_gemm);
  m.impl("l2_prefetch", &l2_prefetch);
}

TORCH_LIBRARY_IMPL(minillm, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_meta);
  m.impl("silu_and_mul", &silu_and_mul_meta);
  m.impl("qk_norm_rope", &qk_norm_rope_meta);
  m.impl("qk_norm_rope_cache", &qk_norm_rope_cache_meta);
  m.impl("qk_norm_rope_cache_fp8", &qk_norm_rope_cache_fp8_meta);
  m.impl("sample_exponential_race", &sample_exponential_race_meta);
  m.impl("seeded_exponential_", &seeded_exponential_meta);
  m.impl("truncation_threshold", &truncation_threshold_meta);
  m.impl("skinny_gemm", &skinny_gemm_meta);
}
