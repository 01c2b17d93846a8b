// Torch bindings of the small-M GEMM launcher (gemm.h): checks the tensors (bad input raises ValueError naming
// the argument), plans the launch from host-side sizes only, allocates the output and the split-K workspace, and
// launches on the current stream. The tile counters are a persistent int32 buffer owned by the caller
// (minillm/ops/gemm_ops.py, one per device): the kernel leaves them zero, so the op is CUDA-graph capturable
// without a memset. The schema marks them mutated (Tensor(a!)) because the kernel writes them during the launch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gemm.h"

namespace {

using at::Tensor;

// Messages are assembled with std::to_string and passed to TORCH_CHECK as one string (see fused_bindings.cpp:
// streaming integers into c10::str from this library crashed on the H200 image).
std::string text(const char* s) { return s; }
std::string text(const std::string& s) { return s; }
std::string text(int64_t v) { return std::to_string(v); }
std::string text(at::ScalarType t) { return c10::toString(t); }
std::string text(const c10::Device& d) { return d.str(); }
std::string text(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

template <typename... Parts>
std::string msg(const Parts&... parts) {
  return (std::string() + ... + text(parts));
}

#define GEMM_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, msg(__VA_ARGS__))

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, msg("minillm.small_m_linear: CUDA error ", cudaGetErrorString(err)));
}

// Plans with the same rules as small_m_linear; tile_m / split_k 0 = heuristic.
minillm::SmallMGemmPlan make_plan(int64_t m, int64_t n, int64_t k, int64_t num_sms, int64_t num_counters,
                                  int64_t tile_m, int64_t split_k) {
  GEMM_CHECK(tile_m == 0 || tile_m == 64 || tile_m == 128 || tile_m == 256, "tile_m must be 0 (auto), 64, 128 or 256, got ",
             tile_m);
  GEMM_CHECK(split_k >= 0 && split_k <= minillm::kSmallMMaxSplit, "split_k must be in [0, ", (int64_t)minillm::kSmallMMaxSplit,
             "] (0 = auto), got ", split_k);
  return minillm::plan_small_m_gemm(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                    static_cast<int>(num_sms), num_counters, static_cast<int>(tile_m),
                                    static_cast<int>(split_k));
}

void check_inputs(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& counters) {
  GEMM_CHECK(x.is_cuda(), "x must be a CUDA tensor, got one on ", x.device());
  const at::ScalarType s = x.scalar_type();
  GEMM_CHECK(s == at::kBFloat16 || s == at::kHalf, "x: dtype must be bfloat16 or float16, got ", s);
  GEMM_CHECK(x.dim() == 2, "x must be 2-D [M, K], got shape ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  GEMM_CHECK(m <= minillm::kSmallMMaxM, "x: M (rows) must be at most ", (int64_t)minillm::kSmallMMaxM, ", got ", m);
  GEMM_CHECK(k > 0 && k % minillm::kSmallMTileK == 0 && k <= INT32_MAX, "x: K must be a positive multiple of ",
             (int64_t)minillm::kSmallMTileK, ", got ", k);
  GEMM_CHECK(x.stride(1) == 1 && (m <= 1 || x.stride(0) % 8 == 0) && aligned16(x),
             "x rows must be contiguous, 16-byte aligned, with a row stride that is a multiple of 8 elements; got "
             "strides ", x.strides());

  GEMM_CHECK(weight.is_cuda() && weight.device() == x.device(), "weight must be on x's device ", x.device(), ", got ",
             weight.device());
  GEMM_CHECK(weight.scalar_type() == s, "weight must have x's dtype ", s, ", got ", weight.scalar_type());
  GEMM_CHECK(weight.dim() == 2 && weight.size(1) == k && weight.is_contiguous() && aligned16(weight),
             "weight must be contiguous, 16-byte aligned [N, ", k, "], got shape ", weight.sizes(), " strides ",
             weight.strides());
  const int64_t n = weight.size(0);
  GEMM_CHECK(n > 0 && n % minillm::kSmallMTileN == 0 && n <= INT32_MAX, "weight: N must be a positive multiple of ",
             (int64_t)minillm::kSmallMTileN, ", got ", n);

  if (bias.has_value()) {
    const Tensor& b = *bias;
    GEMM_CHECK(b.is_cuda() && b.device() == x.device(), "bias must be on x's device ", x.device(), ", got ", b.device());
    GEMM_CHECK(b.scalar_type() == s, "bias must have x's dtype ", s, ", got ", b.scalar_type());
    GEMM_CHECK(b.dim() == 1 && b.size(0) == n && b.is_contiguous(), "bias must be contiguous [", n, "], got shape ",
               b.sizes());
  }
  GEMM_CHECK(counters.is_cuda() && counters.device() == x.device(), "counters must be on x's device ", x.device(),
             ", got ", counters.device());
  GEMM_CHECK(counters.scalar_type() == at::kInt && counters.dim() == 1 && counters.is_contiguous(),
             "counters must be a contiguous 1-D int32 tensor of zeros, got ", counters.scalar_type(), " shape ",
             counters.sizes());
}

Tensor small_m_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, Tensor& counters,
                      int64_t tile_m, int64_t split_k) {
  check_inputs(x, weight, bias, counters);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const minillm::SmallMGemmPlan plan = make_plan(m, n, k, sms, counters.numel(), tile_m, split_k);
  // Sized from host-side values only, so a captured CUDA graph replays with the same workspace.
  Tensor ws;
  if (plan.workspace_floats > 0) ws = at::empty({plan.workspace_floats}, x.options().dtype(at::kFloat));
  minillm::SmallMGemmArgs a{};
  a.x = x.data_ptr();
  a.x_row_stride = m > 1 ? x.stride(0) : k;
  a.weight = weight.data_ptr();
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  a.dtype = x.scalar_type() == at::kBFloat16 ? minillm::GemmDType::kBF16 : minillm::GemmDType::kFP16;
  check_launch(minillm::launch_small_m_gemm(a, plan, ws.defined() ? ws.data_ptr<float>() : nullptr,
                                            plan.split_k > 1 ? counters.data_ptr<int>() : nullptr,
                                            at::cuda::getCurrentCUDAStream()));
  return y;
}

// The launch small_m_linear would make for these sizes: [tile_m, split_k, grid_x, grid_y, grid_z, smem_bytes,
// workspace_floats, counters]. No tensors: for the sweep and for logging which variant runs.
std::vector<int64_t> small_m_linear_plan(int64_t m, int64_t n, int64_t k, int64_t num_sms, int64_t num_counters,
                                         int64_t tile_m, int64_t split_k) {
  GEMM_CHECK(m >= 1 && m <= minillm::kSmallMMaxM, "m must be in [1, ", (int64_t)minillm::kSmallMMaxM, "], got ", m);
  GEMM_CHECK(n > 0 && n % minillm::kSmallMTileN == 0 && n <= INT32_MAX, "n must be a positive multiple of ",
             (int64_t)minillm::kSmallMTileN, ", got ", n);
  GEMM_CHECK(k > 0 && k % minillm::kSmallMTileK == 0 && k <= INT32_MAX, "k must be a positive multiple of ",
             (int64_t)minillm::kSmallMTileK, ", got ", k);
  GEMM_CHECK(num_sms >= 1 && num_sms <= 4096, "num_sms must be in [1, 4096], got ", num_sms);
  const minillm::SmallMGemmPlan p = make_plan(m, n, k, num_sms, num_counters, tile_m, split_k);
  return {p.tile_m, p.split_k, p.grid_x, p.grid_y, p.grid_z, p.smem_bytes, p.workspace_floats, p.counters};
}

// Shape-only twin for torch.compile's fake tensors.
Tensor small_m_linear_meta(const Tensor& x, const Tensor& weight, const std::optional<Tensor>&, Tensor&, int64_t,
                           int64_t) {
  return at::empty({x.size(0), weight.size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) counters, int tile_m=0, int split_k=0) "
        "-> Tensor");
  // No tensor arguments: registered with its implementation (a catch-all kernel), callable on any machine.
  m.def("small_m_linear_plan(int m, int n, int k, int num_sms, int num_counters=65536, int tile_m=0, "
        "int split_k=0) -> int[]",
        &small_m_linear_plan);
}

TORCH_LIBRARY_IMPL(minillm, CUDA, m) { m.impl("small_m_linear", &small_m_linear); }

TORCH_LIBRARY_IMPL(minillm, Meta, m) { m.impl("small_m_linear", &small_m_linear_meta); }
