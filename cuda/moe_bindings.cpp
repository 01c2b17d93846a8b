// Torch bindings of the mixture-of-experts kernels (launchers in moe.h):
//   torch.ops.minillm.moe_route(logits, top_k, renormalize) -> (ids, weights, counts, offsets, order, active)
//   torch.ops.minillm.moe_gate_up(x, w13, order, offsets, active, top_k, act!)
//   torch.ops.minillm.moe_down(act, w2, weights, order, offsets, active, top_k, pairs!)
//   torch.ops.minillm.moe_combine(pairs, top_k, out!)
//   torch.ops.minillm.moe_route_gemv(x, router, top_k, renormalize, counter!)
//       -> (logits, ids, weights, counts, offsets, order, active)
//   torch.ops.minillm.moe_down_combine(act, w2, ids, weights, order, top_k, out!)
// moe_route_gemv is moe_route with the router GEMV in (logits = x router^T in fp32, returned too); counter is the
// caller's int32 word, 0 between launches (the kernel leaves it so). moe_down_combine is moe_down then
// moe_combine in one launch.
// The three expert ops write into caller buffers (declared (a!)), so that check-kernels can hand them
// NaN-poisoned ones and the engine keeps one allocation per shape. The checks here are the limits that
// minillm/ops/moe_ops.py states in COVERAGE and fused_shape_reason(), plus what only a tensor shows (device,
// dtype, contiguity, alignment); each failure raises ValueError naming the argument.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "bindings_util.h"
#include "moe.h"

namespace {

using at::Tensor;
using minillm::bindings::msg;

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, msg("minillm.", op, ": CUDA error ", cudaGetErrorString(err)));
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

minillm::ScalarType expert_dtype(const Tensor& t, const char* name) {
  MINILLM_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, name,
                ": dtype must be bfloat16 or float16, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? minillm::ScalarType::kFloat16 : minillm::ScalarType::kBFloat16;
}

void check_on(const Tensor& t, const Tensor& ref, const char* name) {
  MINILLM_CHECK(t.is_cuda() && t.device() == ref.device(), name, " must be on ", ref.device(), ", got ",
                t.device());
}

void check_int32(const Tensor& t, const Tensor& ref, const char* name, int64_t size) {
  check_on(t, ref, name);
  MINILLM_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == size && t.is_contiguous(), name,
                " must be a contiguous int32 [", size, "] tensor, got ", t.scalar_type(), " ", t.sizes());
}

void check_top_k(int64_t top_k, int64_t experts) {
  MINILLM_CHECK(top_k >= 1 && top_k <= minillm::kMoeMaxTopK && top_k <= experts, "top_k must be in [1, min(",
                int64_t(minillm::kMoeMaxTopK), ", experts=", experts, ")], got ", top_k);
}

// The routing tensors of T tokens over E experts (order [T*k], offsets [E+1], active [E+1]).
void check_routing(const Tensor& order, const Tensor& offsets, const Tensor& active, const Tensor& ref, int64_t n,
                   int64_t experts) {
  check_int32(order, ref, "order", n);
  check_int32(offsets, ref, "offsets", experts + 1);
  check_int32(active, ref, "active", experts + 1);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> moe_route(const Tensor& logits_in, int64_t top_k,
                                                                     bool renormalize) {
  MINILLM_CHECK(logits_in.is_cuda() && logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat,
                "logits must be a CUDA float32 tensor [tokens, experts], got ", logits_in.scalar_type(), " ",
                logits_in.sizes(), " on ", logits_in.device());
  const Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const int64_t t = logits.size(0), e = logits.size(1);
  MINILLM_CHECK(e >= 1 && e <= minillm::kMoeMaxExperts, "logits: experts must be in [1, ",
                int64_t(minillm::kMoeMaxExperts), "], got ", e);
  check_top_k(top_k, e);
  MINILLM_CHECK(t * top_k < (int64_t(1) << 31), "logits: tokens * top_k must fit in int32, got ", t * top_k);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto i32 = logits.options().dtype(at::kInt);
  Tensor ids = at::empty({t, top_k}, i32), weights = at::empty({t, top_k}, logits.options());
  Tensor counts = at::empty({e}, i32), offsets = at::empty({e + 1}, i32), order = at::empty({t * top_k}, i32);
  Tensor active = at::empty({e + 1}, i32);
  check_launch(minillm::launch_moe_route(logits.data_ptr<float>(), logits.stride(0), int(t), int(e), int(top_k),
                                         renormalize, ids.data_ptr<int32_t>(), weights.data_ptr<float>(),
                                         counts.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(),
                                         order.data_ptr<int32_t>(), active.data_ptr<int32_t>(),
                                         at::cuda::getCurrentCUDAStream()),
               "moe_route");
  return {ids, weights, counts, offsets, order, active};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> moe_route_gemv(const Tensor& x_in,
                                                                                const Tensor& router,
                                                                                int64_t top_k, bool renormalize,
                                                                                Tensor& counter) {
  MINILLM_CHECK(x_in.is_cuda() && x_in.dim() == 2, "x must be a CUDA tensor [tokens, hidden], got ", x_in.sizes());
  const minillm::ScalarType dtype = expert_dtype(x_in, "x");
  // rows of 4-element (8-byte) loads; a fresh copy otherwise (contiguous() keeps a misaligned contiguous view)
  const bool rows_ok = x_in.stride(1) == 1 && x_in.stride(0) % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(x_in.data_ptr()) % 8 == 0;
  const Tensor x = rows_ok ? x_in : x_in.clone(at::MemoryFormat::Contiguous);
  const int64_t t = x.size(0), h = x.size(1);
  MINILLM_CHECK(t <= minillm::kMoeRouteGemvTokens, "x: tokens must be at most ",
                int64_t(minillm::kMoeRouteGemvTokens), ", got ", t);
  MINILLM_CHECK(h >= 4 && h % 4 == 0, "x: hidden must be a positive multiple of 4, got ", h);
  check_on(router, x, "router");
  MINILLM_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.size(1) == h &&
                    router.is_contiguous() && aligned16(router),
                "router must be a contiguous, 16-byte aligned float32 [experts, ", h, "] tensor, got ",
                router.scalar_type(), " ", router.sizes());
  const int64_t e = router.size(0);
  MINILLM_CHECK(e >= 1 && e <= minillm::kMoeMaxExperts, "router: experts must be in [1, ",
                int64_t(minillm::kMoeMaxExperts), "], got ", e);
  check_top_k(top_k, e);
  check_int32(counter, x, "counter", 1);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto i32 = x.options().dtype(at::kInt), f32 = x.options().dtype(at::kFloat);
  Tensor logits = at::empty({t, e}, f32), ids = at::empty({t, top_k}, i32), weights = at::empty({t, top_k}, f32);
  Tensor counts = at::empty({e}, i32), offsets = at::empty({e + 1}, i32), order = at::empty({t * top_k}, i32);
  Tensor active = at::empty({e + 1}, i32);
  check_launch(minillm::launch_moe_route_gemv(
                   x.data_ptr(), x.stride(0), router.data_ptr<float>(), int(t), int(e), int(h), int(top_k),
                   renormalize, logits.data_ptr<float>(), ids.data_ptr<int32_t>(), weights.data_ptr<float>(),
                   counts.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(), order.data_ptr<int32_t>(),
                   active.data_ptr<int32_t>(), reinterpret_cast<unsigned*>(counter.data_ptr<int32_t>()), dtype,
                   at::cuda::getCurrentCUDAStream()),
               "moe_route_gemv");
  return {logits, ids, weights, counts, offsets, order, active};
}

void moe_gate_up(const Tensor& x_in, const Tensor& w13, const Tensor& order, const Tensor& offsets,
                 const Tensor& active, int64_t top_k, Tensor& act) {
  MINILLM_CHECK(x_in.is_cuda() && x_in.dim() == 2, "x must be a CUDA tensor [tokens, hidden], got ", x_in.sizes());
  const minillm::ScalarType dtype = expert_dtype(x_in, "x");
  const Tensor x = x_in.stride(1) == 1 && x_in.stride(0) % 8 == 0 && aligned16(x_in) ? x_in : x_in.contiguous();
  const int64_t t = x.size(0), h = x.size(1);
  MINILLM_CHECK(w13.dim() == 3 && w13.size(2) == h && w13.size(1) % 2 == 0 && w13.is_contiguous() &&
                    aligned16(w13) && w13.scalar_type() == x.scalar_type(),
                "w13 must be a contiguous, 16-byte aligned [experts, 2 * intermediate, ", h, "] tensor of x's dtype ",
                x.scalar_type(), ", got ", w13.scalar_type(), " ", w13.sizes());
  check_on(w13, x, "w13");
  const int64_t e = w13.size(0), i = w13.size(1) / 2;
  MINILLM_CHECK(h % minillm::kMoeTileK == 0 && h / minillm::kMoeTileK >= minillm::kMoeKWarps,
                "hidden must be a multiple of ", int64_t(minillm::kMoeTileK), " and at least ",
                int64_t(minillm::kMoeTileK * minillm::kMoeKWarps), ", got ", h);
  MINILLM_CHECK(i % minillm::kMoeGateCols == 0, "intermediate must be a multiple of ",
                int64_t(minillm::kMoeGateCols), ", got ", i);
  MINILLM_CHECK(e >= 1 && e <= minillm::kMoeMaxExperts, "w13: experts must be in [1, ",
                int64_t(minillm::kMoeMaxExperts), "], got ", e);
  check_top_k(top_k, e);
  check_routing(order, offsets, active, x, t * top_k, e);
  check_on(act, x, "act");
  MINILLM_CHECK(act.scalar_type() == x.scalar_type() && act.dim() == 2 && act.size(0) == t * top_k &&
                    act.size(1) == i && act.is_contiguous(),
                "act must be a contiguous [", t * top_k, ", ", i, "] tensor of x's dtype, got ", act.scalar_type(), " ",
                act.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(minillm::launch_moe_gate_up(x.data_ptr(), x.stride(0), w13.data_ptr(), order.data_ptr<int32_t>(),
                                           offsets.data_ptr<int32_t>(), active.data_ptr<int32_t>(), int(t),
                                           int(top_k), int(e), int(h), int(i), act.data_ptr(), dtype,
                                           at::cuda::getCurrentCUDAStream()),
               "moe_gate_up");
}

// What both down launches take: act [pairs, intermediate] and w2 [experts, hidden, intermediate] of one dtype.
struct DownOperands {
  minillm::ScalarType dtype;
  int64_t n, i, e, h;  // pairs, intermediate, experts, hidden
};

DownOperands check_down_operands(const Tensor& act, const Tensor& w2, int64_t top_k) {
  MINILLM_CHECK(act.is_cuda() && act.dim() == 2 && act.is_contiguous() && aligned16(act),
                "act must be a contiguous, 16-byte aligned CUDA tensor [pairs, intermediate], got ", act.sizes());
  const minillm::ScalarType dtype = expert_dtype(act, "act");
  const int64_t n = act.size(0), i = act.size(1);
  MINILLM_CHECK(w2.dim() == 3 && w2.size(2) == i && w2.is_contiguous() && aligned16(w2) &&
                    w2.scalar_type() == act.scalar_type(),
                "w2 must be a contiguous, 16-byte aligned [experts, hidden, ", i, "] tensor of act's dtype, got ",
                w2.scalar_type(), " ", w2.sizes());
  check_on(w2, act, "w2");
  const int64_t e = w2.size(0), h = w2.size(1);
  MINILLM_CHECK(e >= 1 && e <= minillm::kMoeMaxExperts, "w2: experts must be in [1, ",
                int64_t(minillm::kMoeMaxExperts), "], got ", e);
  check_top_k(top_k, e);
  MINILLM_CHECK(n % top_k == 0, "act: rows must be tokens * top_k, got ", n, " rows for top_k=", top_k);
  return {dtype, n, i, e, h};
}

void moe_down(const Tensor& act, const Tensor& w2, const Tensor& weights, const Tensor& order,
              const Tensor& offsets, const Tensor& active, int64_t top_k, Tensor& pairs) {
  const auto [dtype, n, i, e, h] = check_down_operands(act, w2, top_k);
  MINILLM_CHECK(i % minillm::kMoeTileK == 0 && i / minillm::kMoeTileK >= minillm::kMoeKWarps,
                "intermediate must be a multiple of ", int64_t(minillm::kMoeTileK), " and at least ",
                int64_t(minillm::kMoeTileK * minillm::kMoeKWarps), ", got ", i);
  MINILLM_CHECK(h % minillm::kMoeDownCols == 0, "hidden must be a multiple of ", int64_t(minillm::kMoeDownCols),
                ", got ", h);
  check_on(weights, act, "weights");
  MINILLM_CHECK(weights.scalar_type() == at::kFloat && weights.numel() == n && weights.is_contiguous(),
                "weights must be a contiguous float32 tensor of ", n, " routing weights, got ", weights.scalar_type(),
                " ", weights.sizes());
  check_routing(order, offsets, active, act, n, e);
  check_on(pairs, act, "pairs");
  MINILLM_CHECK(pairs.scalar_type() == at::kFloat && pairs.dim() == 2 && pairs.size(0) == n && pairs.size(1) == h &&
                    pairs.is_contiguous() && aligned16(pairs),
                "pairs must be a contiguous, 16-byte aligned float32 [", n, ", ", h, "] tensor, got ",
                pairs.scalar_type(), " ", pairs.sizes());
  const c10::cuda::CUDAGuard guard(act.device());
  check_launch(minillm::launch_moe_down(act.data_ptr(), w2.data_ptr(), weights.data_ptr<float>(),
                                        order.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(),
                                        active.data_ptr<int32_t>(), int(n / top_k), int(top_k), int(e), int(h),
                                        int(i), pairs.data_ptr<float>(), dtype, at::cuda::getCurrentCUDAStream()),
               "moe_down");
}

void moe_combine(const Tensor& pairs, int64_t top_k, Tensor& out) {
  MINILLM_CHECK(pairs.is_cuda() && pairs.scalar_type() == at::kFloat && pairs.dim() == 2 && pairs.is_contiguous() &&
                    aligned16(pairs),
                "pairs must be a contiguous, 16-byte aligned CUDA float32 tensor [tokens * top_k, hidden], got ",
                pairs.scalar_type(), " ", pairs.sizes());
  MINILLM_CHECK(top_k >= 1 && top_k <= minillm::kMoeMaxTopK && pairs.size(0) % top_k == 0,
                "top_k must be in [1, ", int64_t(minillm::kMoeMaxTopK), "] and divide the rows of pairs, got ", top_k,
                " for ", pairs.size(0), " rows");
  const int64_t t = pairs.size(0) / top_k, h = pairs.size(1);
  check_on(out, pairs, "out");
  const minillm::ScalarType dtype = expert_dtype(out, "out");
  MINILLM_CHECK(out.dim() == 2 && out.size(0) == t && out.size(1) == h && out.stride(1) == 1 &&
                    out.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0,
                "out must be a [", t, ", ", h, "] tensor with unit column stride, row stride a multiple of 4, got ",
                out.sizes());
  MINILLM_CHECK(h % 4 == 0 && t <= 65535, "pairs: hidden must be a multiple of 4 and tokens at most 65535, got ", h,
                " and ", t);
  const c10::cuda::CUDAGuard guard(pairs.device());
  check_launch(minillm::launch_moe_combine(pairs.data_ptr<float>(), int(t), int(top_k), int(h), out.data_ptr(),
                                           out.stride(0), dtype, at::cuda::getCurrentCUDAStream()),
               "moe_combine");
}

void moe_down_combine(const Tensor& act, const Tensor& w2, const Tensor& ids, const Tensor& weights,
                      const Tensor& order, int64_t top_k, Tensor& out) {
  const auto [dtype, n, i, e, h] = check_down_operands(act, w2, top_k);
  MINILLM_CHECK(i % 8 == 0, "intermediate must be a multiple of 8, got ", i);
  MINILLM_CHECK(h % minillm::kMoeDownCombineCols == 0, "hidden must be a multiple of ",
                int64_t(minillm::kMoeDownCombineCols), ", got ", h);
  check_on(ids, act, "ids");
  MINILLM_CHECK(ids.scalar_type() == at::kInt && ids.numel() == n && ids.is_contiguous(),
                "ids must be a contiguous int32 tensor of ", n, " expert ids, got ", ids.scalar_type(), " ",
                ids.sizes());
  check_on(weights, act, "weights");
  MINILLM_CHECK(weights.scalar_type() == at::kFloat && weights.numel() == n && weights.is_contiguous(),
                "weights must be a contiguous float32 tensor of ", n, " routing weights, got ", weights.scalar_type(),
                " ", weights.sizes());
  check_int32(order, act, "order", n);
  const int64_t t = n / top_k;
  check_on(out, act, "out");
  MINILLM_CHECK(out.scalar_type() == act.scalar_type() && out.dim() == 2 && out.size(0) == t && out.size(1) == h &&
                    out.stride(1) == 1 && out.stride(0) % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
                "out must be a [", t, ", ", h, "] tensor of act's dtype with unit column stride and an even row ",
                "stride, got ", out.scalar_type(), " ", out.sizes());
  const c10::cuda::CUDAGuard guard(act.device());
  check_launch(minillm::launch_moe_down_combine(act.data_ptr(), w2.data_ptr(), ids.data_ptr<int32_t>(),
                                                weights.data_ptr<float>(), order.data_ptr<int32_t>(), int(t),
                                                int(top_k), int(e), int(h), int(i), out.data_ptr(), out.stride(0),
                                                dtype, at::cuda::getCurrentCUDAStream()),
               "moe_down_combine");
}

// Meta implementations: the output shapes without running anything (torch.compile); the expert ops write only
// into their buffers.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> moe_route_meta(const Tensor& logits, int64_t top_k,
                                                                          bool) {
  const int64_t t = logits.size(0), e = logits.size(1);
  const auto i32 = logits.options().dtype(at::kInt);
  return {at::empty({t, top_k}, i32), at::empty({t, top_k}, logits.options().dtype(at::kFloat)),
          at::empty({e}, i32), at::empty({e + 1}, i32), at::empty({t * top_k}, i32), at::empty({e + 1}, i32)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> moe_route_gemv_meta(const Tensor& x,
                                                                                     const Tensor& router,
                                                                                     int64_t top_k, bool,
                                                                                     Tensor&) {
  const int64_t t = x.size(0), e = router.size(0);
  const auto i32 = x.options().dtype(at::kInt), f32 = x.options().dtype(at::kFloat);
  return {at::empty({t, e}, f32),      at::empty({t, top_k}, i32),     at::empty({t, top_k}, f32),
          at::empty({e}, i32),         at::empty({e + 1}, i32),        at::empty({t * top_k}, i32),
          at::empty({e + 1}, i32)};
}

void moe_gate_up_meta(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                      Tensor&) {}
void moe_down_meta(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                   Tensor&) {}
void moe_combine_meta(const Tensor&, int64_t, Tensor&) {}
void moe_down_combine_meta(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                           Tensor&) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("moe_route(Tensor logits, int top_k, bool renormalize) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_gate_up(Tensor x, Tensor w13, Tensor order, Tensor offsets, Tensor active, int top_k, "
        "Tensor(a!) act) -> ()");
  m.def("moe_down(Tensor act, Tensor w2, Tensor weights, Tensor order, Tensor offsets, Tensor active, int top_k, "
        "Tensor(a!) pairs) -> ()");
  m.def("moe_combine(Tensor pairs, int top_k, Tensor(a!) out) -> ()");
  m.def("moe_route_gemv(Tensor x, Tensor router, int top_k, bool renormalize, Tensor(a!) counter) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_down_combine(Tensor act, Tensor w2, Tensor ids, Tensor weights, Tensor order, int top_k, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(minillm, CUDA, m) {
  m.impl("moe_route", &moe_route);
  m.impl("moe_gate_up", &moe_gate_up);
  m.impl("moe_down", &moe_down);
  m.impl("moe_combine", &moe_combine);
  m.impl("moe_route_gemv", &moe_route_gemv);
  m.impl("moe_down_combine", &moe_down_combine);
}

TORCH_LIBRARY_IMPL(minillm, Meta, m) {
  m.impl("moe_route", &moe_route_meta);
  m.impl("moe_gate_up", &moe_gate_up_meta);
  m.impl("moe_down", &moe_down_meta);
  m.impl("moe_combine", &moe_combine_meta);
  m.impl("moe_route_gemv", &moe_route_gemv_meta);
  m.impl("moe_down_combine", &moe_down_combine_meta);
}
