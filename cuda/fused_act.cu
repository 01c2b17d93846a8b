// SwiGLU activation: out = silu(gate) * up from the packed [gate | up] rows of the gate_up projection.
//
// Variants: dtype (fp32, fp16, bf16) x access width (16-byte vectors; scalars when a pointer, the row stride or
// the intermediate size is not a multiple of the vector). One CTA per row walks the row in vectors, so the two
// halves are read once and the output written once. Rounding follows torch's F.silu(gate) * up in the
// activation dtype: silu is computed in fp32 and rounded, then the product is rounded.
// Compile-only check: nvcc -c -gencode arch=compute_90a,code=sm_90a -Xptxas -v cuda/fused_act.cu
#include "fused.h"
#include "launch.h"

namespace minillm {
namespace {
using namespace fused_detail;

constexpr int kMaxThreads = 512;

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    silu_and_mul_kernel(const T* __restrict__ gate_up, int64_t in_stride, T* __restrict__ out, int inter) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  const int64_t row = blockIdx.x;
  const T* gate = gate_up + row * in_stride;
  const T* up = gate + inter;
  T* dst = out + row * inter;
  for (int c = threadIdx.x * VEC; c < inter; c += blockDim.x * VEC) {
    float g[VEC], u[VEC];
    load_vec<T, VEC>(gate + c, g);
    load_vec<T, VEC>(up + c, u);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float silu = to_float(from_float<T>(g[e] / (1.f + expf(-g[e]))));
      g[e] = silu * u[e];
    }
    store_vec<T, VEC>(dst + c, g);
  }
}

template <typename T, int VEC>
cudaError_t launch(const T* gate_up, int64_t in_stride, T* out, int64_t rows, int inter, cudaStream_t stream) {
  const int nvec = inter / VEC;
  int threads = (nvec + 31) / 32 * 32;
  threads = threads > kMaxThreads ? kMaxThreads : threads;
  return launch_kernel(silu_and_mul_kernel<T, VEC>, dim3(rows), dim3(threads), 0, stream, gate_up, in_stride, out,
                       inter);
}

}  // namespace

cudaError_t launch_silu_and_mul(const void* gate_up, int64_t in_row_stride, void* out, int64_t rows,
                                int64_t inter, ScalarType dtype, cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX || inter <= 0 || inter > INT32_MAX / 2) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const T* in = static_cast<const T*>(gate_up);
    T* dst = static_cast<T*>(out);
    const int n = static_cast<int>(inter);
    return vector_width<T>({gate_up, out}, {in_row_stride, inter}) == kVec
               ? launch<T, kVec>(in, in_row_stride, dst, rows, n, stream)
               : launch<T, 1>(in, in_row_stride, dst, rows, n, stream);
  });
}

}  // namespace minillm
