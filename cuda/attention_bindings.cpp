// Torch bindings of the attention launchers: checks the tensors, turns them into raw pointers, sizes and
// strides, launches on the current stream, and registers the ops as torch custom ops (namespace minillm) with
// the tensors they mutate declared, so CUDA graphs and torch.compile see the writes.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "attention.h"

namespace {

using at::Tensor;

minillm::ScalarType dtype_code(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "minillm attention: dtype must be bfloat16 or float16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? minillm::ScalarType::kBFloat16 : minillm::ScalarType::kFloat16;
}

void check_cuda_ok(cudaError_t err, const char* what) {
  TORCH_CHECK(err != cudaErrorInvalidValue, what, ": unsupported configuration (head_dim 64/128, block_size 16/32, "
              "num_q_heads a multiple of num_kv_heads with a group of at most 16, 16-byte aligned rows)");
  TORCH_CHECK(err == cudaSuccess, what, ": CUDA error ", cudaGetErrorString(err));
}

bool is_fp8(const Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

minillm::ScalarType cache_code(const Tensor& cache, const Tensor& like) {
  if (cache.scalar_type() == at::kFloat8_e4m3fn) return minillm::ScalarType::kFloat8E4M3;
  if (cache.scalar_type() == at::kFloat8_e5m2) return minillm::ScalarType::kFloat8E5M2;
  return dtype_code(like);
}

// fp8 = true: the cache is float8_e4m3fn / float8_e5m2 (the _fp8 ops); false: it holds q/k's own dtype.
void check_cache(const Tensor& cache, const Tensor& like, bool fp8 = false) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(),
              "k_cache/v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(fp8 ? is_fp8(cache) : cache.scalar_type() == like.scalar_type(),
              fp8 ? "cache dtype must be float8_e4m3fn or float8_e5m2" : "cache dtype must match q/k dtype");
  TORCH_CHECK(cache.is_cuda() && cache.device() == like.device(), "cache must be on the same CUDA device");
}

void check_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

void kv_write(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache, const Tensor& slot_mapping) {
  check_rows(k, "k");
  check_rows(v, "v");
  check_cache(k_cache, k);
  check_cache(v_cache, k);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  TORCH_CHECK(slot_mapping.size(0) >= k.size(0) && v.sizes() == k.sizes(), "k, v, slot_mapping sizes disagree");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k heads/head_dim differ from the cache");
  dtype_code(k);
  const at::cuda::CUDAGuard guard(k.device());
  check_cuda_ok(minillm::launch_kv_write(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                         k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr<int64_t>(),
                                         (int)k.size(0), (int)k.size(1), (int)k.size(2),
                                         at::cuda::getCurrentCUDAStream()),
                "kv_write");
}

// Per-KV-head fp32 scales of an fp8 cache: [num_kv_heads], contiguous, on the cache's device.
void check_scales(const Tensor& s, const Tensor& cache, const char* name) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.is_contiguous() && s.size(0) == cache.size(2) &&
                  s.device() == cache.device(),
              name, " must be contiguous float32 [num_kv_heads] on the cache's device");
}

void kv_write_fp8(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache, const Tensor& slot_mapping,
                  const Tensor& k_scale, const Tensor& v_scale) {
  check_rows(k, "k");
  check_rows(v, "v");
  check_cache(k_cache, k, true);
  check_cache(v_cache, k, true);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  check_scales(k_scale, k_cache, "k_scale");
  check_scales(v_scale, v_cache, "v_scale");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  TORCH_CHECK(slot_mapping.size(0) >= k.size(0) && v.sizes() == k.sizes(), "k, v, slot_mapping sizes disagree");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k heads/head_dim differ from the cache");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "k and v dtypes differ");
  const at::cuda::CUDAGuard guard(k.device());
  check_cuda_ok(minillm::launch_kv_write_fp8(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0),
                                             v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                                             slot_mapping.data_ptr<int64_t>(), k_scale.data_ptr<float>(),
                                             v_scale.data_ptr<float>(), (int)k.size(0), (int)k.size(1),
                                             (int)k.size(2), dtype_code(k), cache_code(k_cache, k),
                                             at::cuda::getCurrentCUDAStream()),
                "kv_write_fp8");
}

minillm::PagedAttnArgs make_args(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                 const Tensor& block_tables, const Tensor& seq_lens, double scale, bool fp8 = false) {
  check_rows(out, "out");
  check_rows(q, "q");
  check_cache(k_cache, q, fp8);
  check_cache(v_cache, q, fp8);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out dtype must match q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be contiguous int32");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q head_dim differs from the cache");
  minillm::PagedAttnArgs a{};
  a.out = out.data_ptr();
  a.out_stride_t = out.stride(0);
  a.out_stride_h = out.stride(1);
  a.q = q.data_ptr();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int>();
  a.bt_stride = block_tables.stride(0);
  a.seq_lens = seq_lens.data_ptr<int>();
  a.num_q_heads = (int)q.size(1);
  a.num_kv_heads = (int)k_cache.size(2);
  a.head_dim = (int)q.size(2);
  a.block_size = (int)k_cache.size(1);
  a.scale = (float)scale;
  a.dtype = dtype_code(q);
  return a;
}

void launch_decode(minillm::PagedAttnArgs a, const minillm::KvQuant* quant, const Tensor& q,
                   const Tensor& block_tables, const Tensor& seq_lens, int64_t partition_size, int64_t max_seq_len);

// The KvQuant of fp8 caches with their scales (checked).
minillm::KvQuant quant_args(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& k_scale,
                            const Tensor& v_scale) {
  check_scales(k_scale, k_cache, "k_scale");
  check_scales(v_scale, v_cache, "v_scale");
  return {cache_code(k_cache, q), k_scale.data_ptr<float>(), v_scale.data_ptr<float>()};
}

void paged_decode(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& block_tables, const Tensor& seq_lens, double scale, int64_t partition_size,
                  int64_t max_seq_len) {
  launch_decode(make_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale), nullptr, q, block_tables,
                seq_lens, partition_size, max_seq_len);
}

void paged_decode_fp8(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& block_tables, const Tensor& seq_lens, const Tensor& k_scale, const Tensor& v_scale,
                      double scale, int64_t partition_size, int64_t max_seq_len) {
  const minillm::PagedAttnArgs a = make_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale, true);
  const minillm::KvQuant quant = quant_args(q, k_cache, v_cache, k_scale, v_scale);
  launch_decode(a, &quant, q, block_tables, seq_lens, partition_size, max_seq_len);
}

void launch_decode(minillm::PagedAttnArgs a, const minillm::KvQuant* quant, const Tensor& q,
                   const Tensor& block_tables, const Tensor& seq_lens, int64_t partition_size, int64_t max_seq_len) {
  a.num_seqs = (int)q.size(0);
  TORCH_CHECK(block_tables.size(0) >= a.num_seqs && seq_lens.size(0) >= a.num_seqs,
              "decode: block_tables/seq_lens have fewer rows than q");
  const at::cuda::CUDAGuard guard(q.device());
  int num_partitions = 0;
  Tensor ws;
  float* ws_out = nullptr;
  if (partition_size != 0) {
    // Sized from host-side values only, so a captured CUDA graph replays with the same workspace.
    num_partitions = partition_size < 0 ? (int)-partition_size
                                        : (int)((max_seq_len + partition_size - 1) / partition_size);
    const int64_t rows = (int64_t)a.num_seqs * a.num_q_heads * num_partitions;
    ws = at::empty({rows * (a.head_dim + 2)}, q.options().dtype(at::kFloat));
    ws_out = ws.data_ptr<float>();
  }
  const int64_t rows = (int64_t)a.num_seqs * a.num_q_heads * num_partitions;
  float* ws_max = ws_out ? ws_out + rows * a.head_dim : nullptr;
  float* ws_sum = ws_out ? ws_max + rows : nullptr;
  check_cuda_ok(minillm::launch_paged_decode(a, (int)partition_size, num_partitions, ws_out, ws_max, ws_sum,
                                             at::cuda::getCurrentCUDAStream(), quant),
                "paged_decode");
}

// Which prefill launcher: paged_prefill.cu (any cache), prefill_wide.cu or prefill_wgmma.cu (q's dtype only).
enum class Prefill { kNarrow, kWide, kWgmma };

void launch_prefill(minillm::PagedAttnArgs a, const minillm::KvQuant* quant, const Tensor& seq_lens,
                    const Tensor& query_start_loc, int64_t seq_begin, int64_t num_seqs, int64_t max_query_len,
                    const Tensor& q, Prefill kernel = Prefill::kNarrow, int warpgroups = 0);

void paged_prefill(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                   const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                   int64_t seq_begin, int64_t num_seqs, int64_t max_query_len, double scale) {
  launch_prefill(make_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale), nullptr, seq_lens,
                 query_start_loc, seq_begin, num_seqs, max_query_len, q);
}

void paged_prefill_fp8(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                       const Tensor& k_scale, const Tensor& v_scale, int64_t seq_begin, int64_t num_seqs,
                       int64_t max_query_len, double scale) {
  const minillm::PagedAttnArgs a = make_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale, true);
  const minillm::KvQuant quant = quant_args(q, k_cache, v_cache, k_scale, v_scale);
  launch_prefill(a, &quant, seq_lens, query_start_loc, seq_begin, num_seqs, max_query_len, q);
}

void paged_prefill_wide(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                        int64_t seq_begin, int64_t num_seqs, int64_t max_query_len, double scale) {
  launch_prefill(make_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale), nullptr, seq_lens,
                 query_start_loc, seq_begin, num_seqs, max_query_len, q, Prefill::kWide);
}

void paged_prefill_wgmma(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                         int64_t seq_begin, int64_t num_seqs, int64_t max_query_len, double scale, int64_t warpgroups) {
  launch_prefill(make_args(out, q, k_cache, v_cache, block_tables, seq_lens, scale), nullptr, seq_lens,
                 query_start_loc, seq_begin, num_seqs, max_query_len, q, Prefill::kWgmma, (int)warpgroups);
}

void launch_prefill(minillm::PagedAttnArgs a, const minillm::KvQuant* quant, const Tensor& seq_lens,
                    const Tensor& query_start_loc, int64_t seq_begin, int64_t num_seqs, int64_t max_query_len,
                    const Tensor& q, Prefill kernel, int warpgroups) {
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(),
              "query_start_loc must be contiguous int32");
  TORCH_CHECK(seq_begin >= 0 && seq_begin + num_seqs <= seq_lens.size(0) &&
                  query_start_loc.size(0) >= seq_begin + num_seqs + 1,
              "prefill: seq_begin/num_seqs outside the batch");
  a.num_seqs = (int)num_seqs;
  const at::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (kernel == Prefill::kWide) {
    check_cuda_ok(minillm::launch_paged_prefill_wide(a, query_start_loc.data_ptr<int>(), (int)seq_begin,
                                                     (int)max_query_len, stream),
                  "paged_prefill_wide");
    return;
  }
  if (kernel == Prefill::kWgmma) {
    check_cuda_ok(minillm::launch_paged_prefill_wgmma(a, query_start_loc.data_ptr<int>(), (int)seq_begin,
                                                      (int)max_query_len, stream, warpgroups),
                  "paged_prefill_wgmma");
    return;
  }
  check_cuda_ok(minillm::launch_paged_prefill(a, query_start_loc.data_ptr<int>(), (int)seq_begin, (int)max_query_len,
                                              stream, quant),
                "paged_prefill");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("kv_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int partition_size, int max_seq_len) -> ()");
  m.def("kv_write_fp8(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor k_scale, Tensor v_scale) -> ()");
  m.def("paged_prefill_fp8(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor k_scale, Tensor v_scale, int seq_begin, int num_seqs, "
        "int max_query_len, float scale) -> ()");
  m.def("paged_decode_fp8(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor k_scale, Tensor v_scale, float scale, int partition_size, int max_seq_len) -> ()");
  m.def("paged_prefill(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int seq_begin, int num_seqs, int max_query_len, float scale) -> ()");
  m.def("paged_prefill_wide(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int seq_begin, int num_seqs, int max_query_len, float scale) -> ()");
  m.def("paged_prefill_wgmma(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int seq_begin, int num_seqs, int max_query_len, float scale, "
        "int warpgroups) -> ()");
}

TORCH_LIBRARY_IMPL(minillm, CUDA, m) {
  m.impl("kv_write", &kv_write);
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("kv_write_fp8", &kv_write_fp8);
  m.impl("paged_decode_fp8", &paged_decode_fp8);
  m.impl("paged_prefill_fp8", &paged_prefill_fp8);
  m.impl("paged_prefill_wide", &paged_prefill_wide);
  m.impl("paged_prefill_wgmma", &paged_prefill_wgmma);
}
