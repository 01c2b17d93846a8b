// Torch binding of the persistent decode kernel (launcher in megakernel.h, kernel in decode_megakernel.cu).
//
// torch.ops.minillm.decode_megakernel runs every decoder layer of one decode step. It writes the KV caches (the
// new token of every row whose slot is >= 0), its workspaces, `out` and the optional timeline buffer `profile`
// (megakernel.h: kMegaProfPoints), all declared mutated in the schema ((a!)..(f!)), so CUDA graphs and
// torch.compile see the writes; it returns nothing and allocates nothing, so a call can be captured in a CUDA
// graph. Bad input raises ValueError naming the argument. The Python side
// (minillm/ops/megakernel.py, DecodeMegakernel) packs the weights and owns the workspaces.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "bindings_util.h"
#include "megakernel.h"

namespace {

using at::Tensor;
using minillm::bindings::msg;

// A contiguous CUDA tensor on `device` with `dtype` and at least `numel` elements.
void check_buffer(const Tensor& t, const char* name, const c10::Device& device, at::ScalarType dtype, int64_t numel) {
  MINILLM_CHECK(t.is_cuda() && t.device() == device, name, " must be on ", device, ", got ", t.device());
  MINILLM_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  MINILLM_CHECK(t.is_contiguous(), name, " must be contiguous");
  MINILLM_CHECK(t.numel() >= numel, name, " must hold at least ", numel, " elements, got shape ", t.sizes());
  MINILLM_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

// A step input: CUDA, `dtype`, at least `rows` leading entries, unit last stride.
void check_input(const Tensor& t, const char* name, const c10::Device& device, at::ScalarType dtype, int64_t rows,
                 int64_t dims) {
  MINILLM_CHECK(t.is_cuda() && t.device() == device, name, " must be on ", device, ", got ", t.device());
  MINILLM_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  MINILLM_CHECK(t.dim() == dims && t.size(0) >= rows && t.stride(-1) == 1, name, " must be a ", dims,
             "-d tensor with at least ", rows, " rows and a unit last stride, got shape ", t.sizes());
}

void decode_megakernel(const Tensor& input_ids, const Tensor& positions, const Tensor& slot_mapping,
                       const Tensor& seq_lens, const Tensor& block_tables, at::TensorList kv_caches, const Tensor& embed,
                       const Tensor& w_qkv, const std::optional<Tensor>& b_qkv, const Tensor& w_o, const Tensor& w_gu,
                       const Tensor& w_down, const Tensor& ln1, const Tensor& ln2, const std::optional<Tensor>& q_norm,
                       const std::optional<Tensor>& k_norm, const Tensor& final_norm, const Tensor& cos_sin,
                       Tensor& act_ws, Tensor& partials, Tensor& sync, Tensor& out, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
                       int64_t num_ctas, int64_t min_partition_chunks, bool cooperative,
                       const std::optional<Tensor>& profile, int64_t profile_flags) {
  MINILLM_CHECK(embed.is_cuda() && embed.dim() == 2, "embed must be a CUDA tensor [vocab, hidden], got ", embed.sizes());
  const c10::Device device = embed.device();
  const at::ScalarType dt = embed.scalar_type();
  MINILLM_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "embed: dtype must be bfloat16 or float16, got ", dt);
  const int64_t batch = input_ids.dim() == 1 ? input_ids.size(0) : -1;
  MINILLM_CHECK(batch >= 1 && batch <= minillm::kMegaMaxBatch, "input_ids must be [B] with 1 <= B <= ",
             int64_t(minillm::kMegaMaxBatch), ", got shape ", input_ids.sizes());
  check_input(input_ids, "input_ids", device, at::kLong, batch, 1);
  check_input(positions, "positions", device, at::kLong, batch, 1);
  check_input(slot_mapping, "slot_mapping", device, at::kLong, batch, 1);
  check_input(seq_lens, "seq_lens", device, at::kInt, batch, 1);
  check_input(block_tables, "block_tables", device, at::kInt, batch, 2);

  const int64_t hidden = embed.size(1), layers = int64_t(kv_caches.size()) / 2;
  MINILLM_CHECK(kv_caches.size() % 2 == 0 && layers >= 1 && layers <= minillm::kMegaMaxLayers,
             "kv_caches must list (k_cache, v_cache) of every layer (1 to ", int64_t(minillm::kMegaMaxLayers),
             " layers), got ", int64_t(kv_caches.size()), " tensors");
  MINILLM_CHECK(num_heads >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
             "num_heads must be a multiple of num_kv_heads, got ", num_heads, " and ", num_kv_heads);
  const int64_t nqkv = (num_heads + 2 * num_kv_heads) * head_dim, kq = num_heads * head_dim;
  const int64_t group = num_heads / num_kv_heads;

  minillm::MegakernelParams p{};
  const Tensor& k0 = kv_caches[0];
  MINILLM_CHECK(k0.dim() == 4 && k0.size(2) == num_kv_heads && k0.size(3) == head_dim,
             "kv_caches[0] must be [num_blocks, block_size, ", num_kv_heads, ", ", head_dim, "], got ", k0.sizes());
  for (int64_t i = 0; i < 2 * layers; ++i) {
    const Tensor& c = kv_caches[i];
    check_buffer(c, "kv_caches[i]", device, dt, 0);
    MINILLM_CHECK(c.sizes() == k0.sizes(), "every KV cache must have kv_caches[0]'s shape ", k0.sizes(), ", entry ", i,
               " has ", c.sizes());
    (i % 2 == 0 ? p.k_cache : p.v_cache)[i / 2] = c.data_ptr();
  }
  check_buffer(w_qkv, "w_qkv", device, dt, layers * nqkv * hidden);
  check_buffer(w_o, "w_o", device, dt, layers * hidden * kq);
  check_buffer(w_gu, "w_gu", device, dt, layers * 2 * intermediate * hidden);
  check_buffer(w_down, "w_down", device, dt, layers * hidden * intermediate);
  if (b_qkv) check_buffer(*b_qkv, "b_qkv", device, dt, layers * nqkv);
  check_buffer(ln1, "ln1", device, dt, layers * hidden);
  check_buffer(ln2, "ln2", device, dt, layers * hidden);
  MINILLM_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm must be given together (Qwen3) or both None");
  if (q_norm) {
    check_buffer(*q_norm, "q_norm", device, dt, layers * head_dim);
    check_buffer(*k_norm, "k_norm", device, dt, layers * head_dim);
  }
  check_buffer(final_norm, "final_norm", device, dt, hidden);
  check_buffer(embed, "embed", device, dt, 0);
  MINILLM_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == head_dim, "cos_sin must be [max_positions, ", head_dim,
             "], got ", cos_sin.sizes());
  check_buffer(cos_sin, "cos_sin", device, at::kFloat, 0);
  const int64_t mb = minillm::kMegaMaxBatch;
  check_buffer(act_ws, "act_ws", device, dt, mb * (nqkv + kq + intermediate + hidden));
  check_buffer(partials, "partials", device, at::kFloat, num_ctas * group * (head_dim + 2));
  check_buffer(sync, "sync", device, at::kInt, minillm::megakernel_sync_words(int(num_kv_heads)));
  check_buffer(out, "out", device, dt, batch * hidden);
  MINILLM_CHECK(out.dim() == 2 && out.size(1) == hidden, "out must be [rows, ", hidden, "], got ", out.sizes());

  p.input_ids = input_ids.data_ptr<int64_t>();
  p.positions = positions.data_ptr<int64_t>();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.block_tables = block_tables.data_ptr<int>();
  p.bt_stride = block_tables.stride(0);
  p.batch = int(batch);
  p.num_layers = int(layers);
  p.hidden = int(hidden);
  p.inter = int(intermediate);
  p.num_heads = int(num_heads);
  p.num_kv_heads = int(num_kv_heads);
  p.head_dim = int(head_dim);
  p.block_size = int(k0.size(1));
  p.eps = float(eps);
  p.scale = float(scale);
  p.max_positions = cos_sin.size(0);
  p.embed = embed.data_ptr();
  p.vocab_size = embed.size(0);
  p.w_qkv = w_qkv.data_ptr();
  p.w_o = w_o.data_ptr();
  p.w_gu = w_gu.data_ptr();
  p.w_down = w_down.data_ptr();
  p.b_qkv = b_qkv ? b_qkv->data_ptr() : nullptr;
  p.ln1 = ln1.data_ptr();
  p.ln2 = ln2.data_ptr();
  p.q_norm = q_norm ? q_norm->data_ptr() : nullptr;
  p.k_norm = k_norm ? k_norm->data_ptr() : nullptr;
  p.final_norm = final_norm.data_ptr();
  p.cos_sin = cos_sin.data_ptr<float>();
  char* ws = static_cast<char*>(act_ws.data_ptr());
  const int64_t esz = act_ws.element_size();
  p.qkv = ws;
  p.attn_frag = ws + esz * mb * nqkv;
  p.h_frag = ws + esz * mb * (nqkv + kq);
  p.resid = ws + esz * mb * (nqkv + kq + intermediate);
  p.out = out.data_ptr();
  p.partials = partials.data_ptr<float>();
  p.sync = reinterpret_cast<unsigned*>(sync.data_ptr<int>());
  p.num_ctas = int(num_ctas);
  p.min_partition_chunks = int(min_partition_chunks);
  p.cooperative = cooperative ? 1 : 0;
  if (profile) {
    check_buffer(*profile, "profile", device, at::kLong, minillm::megakernel_prof_words(int(layers), int(num_ctas)));
    p.prof = reinterpret_cast<unsigned long long*>(profile->data_ptr<int64_t>());
  }
  MINILLM_CHECK(profile_flags == 0 || (profile && profile_flags == minillm::kMegaProfSerialWeights),
                "profile_flags must be 0, or ", int64_t(minillm::kMegaProfSerialWeights),
                " (serial weight copies) with a profile buffer; got ", profile_flags);
  p.prof_flags = int(profile_flags);
  p.dtype = dt == at::kBFloat16 ? minillm::ScalarType::kBFloat16 : minillm::ScalarType::kFloat16;

  minillm::MegakernelSmemPlan plan;
  MINILLM_CHECK(minillm::megakernel_smem_plan(p, &plan) == cudaSuccess,
             "decode_megakernel does not cover this shape (hidden ", hidden, ", intermediate ", intermediate,
             ", heads ", num_heads, "/", num_kv_heads, ", head_dim ", head_dim, ", block_size ", int64_t(p.block_size),
             ", ", num_ctas, " CTAs); see minillm/ops/megakernel.py: DecodeMegakernel.applies");
  const c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = minillm::launch_decode_megakernel(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, msg("minillm.decode_megakernel: CUDA error ", cudaGetErrorString(err),
                                      " (shared memory per CTA: ", int64_t(plan.total), " bytes)"));
}

// Nothing to compute for fake tensors: the op only writes into its arguments.
void decode_megakernel_meta(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::TensorList,
                            const Tensor&, const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                            const std::optional<Tensor>&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&,
                            Tensor&, int64_t, int64_t, int64_t, int64_t, double, double, int64_t, int64_t, bool,
                            const std::optional<Tensor>&, int64_t) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("decode_megakernel(Tensor input_ids, Tensor positions, Tensor slot_mapping, Tensor seq_lens, "
        "Tensor block_tables, Tensor(a!)[] kv_caches, Tensor embed, Tensor w_qkv, Tensor? b_qkv, Tensor w_o, "
        "Tensor w_gu, Tensor w_down, Tensor ln1, Tensor ln2, Tensor? q_norm, Tensor? k_norm, Tensor final_norm, "
        "Tensor cos_sin, Tensor(b!) act_ws, Tensor(c!) partials, Tensor(d!) sync, Tensor(e!) out, int num_heads, "
        "int num_kv_heads, int head_dim, int intermediate, float eps, float scale, int num_ctas, "
        "int min_partition_chunks, bool cooperative, Tensor(f!)? profile=None, int profile_flags=0) -> ()");
}

TORCH_LIBRARY_IMPL(minillm, CUDA, m) { m.impl("decode_megakernel", &decode_megakernel); }

TORCH_LIBRARY_IMPL(minillm, Meta, m) { m.impl("decode_megakernel", &decode_megakernel_meta); }
