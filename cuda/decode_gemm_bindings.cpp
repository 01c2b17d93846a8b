// Torch binding of the decode GEMM (launcher in decode_gemm.h): torch.ops.minillm.decode_gemm(x, w, splits,
// row_warps).
//
// The checks here are the ones minillm/ops/decode_gemm.py's covers() states (M, N, K, dtype), the legal
// (splits, row_warps) of decode_gemm_config_ok(), plus what only a tensor shows (device, contiguity, alignment); each failure raises ValueError naming the argument.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "bindings_util.h"
#include "decode_gemm.h"

namespace {

using at::Tensor;
using minillm::bindings::msg;

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

Tensor decode_gemm(const Tensor& x_in, const Tensor& w, int64_t splits, int64_t row_warps) {
  MINILLM_CHECK(x_in.is_cuda() && x_in.dim() == 2, "x must be a CUDA tensor [M, K], got ", x_in.sizes(), " on ",
                x_in.device());
  MINILLM_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kHalf,
                "x: dtype must be bfloat16 or float16, got ", x_in.scalar_type());
  MINILLM_CHECK(w.is_cuda() && w.device() == x_in.device() && w.scalar_type() == x_in.scalar_type(),
                "w must be on x's device ", x_in.device(), " with x's dtype ", x_in.scalar_type(), ", got ",
                w.device(), " ", w.scalar_type());
  const int major = at::cuda::getDeviceProperties(x_in.device().index())->major;
  MINILLM_CHECK(major == 9, "decode_gemm needs an sm_90 GPU (clusters, distributed shared memory), got compute ",
                "capability ", int64_t(major), ".x");
  // 16-byte loads: x rows must start 16-byte aligned, else a contiguous copy is made.
  const bool x_ok = x_in.stride(1) == 1 && x_in.stride(0) % 8 == 0 && aligned16(x_in);
  const Tensor x = x_ok ? x_in : x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  MINILLM_CHECK(w.dim() == 2 && w.size(1) == k && w.is_contiguous() && aligned16(w),
                "w must be contiguous, 16-byte aligned [N, ", k, "], got ", w.sizes());
  const int64_t n = w.size(0);
  MINILLM_CHECK(m <= minillm::kDecodeGemmMaxRows, "x: M must be at most ", int64_t(minillm::kDecodeGemmMaxRows),
                ", got ", m);
  MINILLM_CHECK(n > 0 && n % minillm::kDecodeGemmAlignN == 0, "w: N must be a positive multiple of ",
                int64_t(minillm::kDecodeGemmAlignN), ", got ", n);
  MINILLM_CHECK(k > 0 && k % minillm::kDecodeGemmTileK == 0, "K must be a positive multiple of ",
                int64_t(minillm::kDecodeGemmTileK), ", got ", k);
  MINILLM_CHECK(minillm::decode_gemm_config_ok(int(k), int(splits), int(row_warps)),
                "splits and row_warps must satisfy row_warps in {1, 2, 4, 8}, splits in [1, ",
                int64_t(minillm::kDecodeGemmMaxSplits), "] and splits * 8 / row_warps <= K / ",
                int64_t(minillm::kDecodeGemmTileK), ", got splits=", splits, " row_warps=", row_warps, " for K=", k);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty({m, n}, x.options());
  const minillm::ScalarType dtype =
      x.scalar_type() == at::kHalf ? minillm::ScalarType::kFloat16 : minillm::ScalarType::kBFloat16;
  const cudaError_t err =
      minillm::launch_decode_gemm(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), y.stride(0),
                                  int(m), int(n), int(k), int(splits), int(row_warps), dtype,
                                  at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, msg("minillm.decode_gemm: CUDA error ", cudaGetErrorString(err)));
  return y;
}

Tensor decode_gemm_meta(const Tensor& x, const Tensor& w, int64_t, int64_t) {
  return at::empty({x.size(0), w.size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("decode_gemm(Tensor x, Tensor w, int splits, int row_warps) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm, CUDA, m) { m.impl("decode_gemm", &decode_gemm); }

TORCH_LIBRARY_IMPL(minillm, Meta, m) { m.impl("decode_gemm", &decode_gemm_meta); }
