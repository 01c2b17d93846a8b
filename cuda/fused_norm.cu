// RMSNorm and fused residual-add + RMSNorm, one pass over each row.
//
// Variants: dtype (fp32, fp16, bf16) x access width (16-byte vectors; scalars when a pointer or stride is not
// aligned) x vectors per thread (VPT, the row is held in registers between the reduction and the scaling, so
// x and residual are read once and y and sum written once). A row belongs to `tpr` threads (blockDim.x, a
// power of two); short rows share a 128-thread CTA (blockDim.y rows) so small hidden sizes still fill it.
// Arithmetic follows minillm/ops/fused_ops.py: fp32 math, the sum rounded to the activation dtype before
// the norm, y = round((x * inv_rms) * w).
// Compile-only check: nvcc -c -gencode arch=compute_90a,code=sm_90a -Xptxas -v cuda/fused_norm.cu
#include "fused.h"
#include "launch.h"

namespace minillm {
namespace {
using namespace fused_detail;

constexpr int kCtaThreads = 128;
constexpr int kMaxRowThreads = 1024;

template <typename T>
struct NormArgs {
  const T* x;
  int64_t x_stride;
  const T* residual;  // null for plain rms_norm
  int64_t residual_stride;
  const T* weight;
  T* y;
  T* sum;  // null for plain rms_norm
  int64_t rows;
  int hidden;
  float eps;
};

// Sum over the blockDim.x threads of this thread's row; red holds one slot per warp of the CTA.
__device__ __forceinline__ float row_sum(float v, float* red) {
  const int tpr = blockDim.x;
  v = group_sum(v, tpr < 32 ? tpr : 32);
  if (tpr <= 32) return v;
  const int warps_per_row = tpr / 32;
  const int first = threadIdx.y * warps_per_row;
  if ((threadIdx.x & 31) == 0) red[first + threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < warps_per_row; ++i) total += red[first + i];
  return total;
}

template <typename T, int VEC, int VPT, bool ADD>
__global__ void __launch_bounds__(kMaxRowThreads) rms_norm_kernel(const NormArgs<T> a) {
  pdl_enter();  // launch.h: before the first access to memory the kernel before it touches
  __shared__ float red[kMaxRowThreads / 32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  // Rows past the end still join the reduction (it synchronises the CTA) but touch no memory.
  const bool live = row < a.rows;
  float v[VPT][VEC];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = (threadIdx.x + i * blockDim.x) * VEC;
    if (!live || c >= a.hidden) continue;
    load_vec<T, VEC>(a.x + row * a.x_stride + c, v[i]);
    if constexpr (ADD) {
      float r[VEC];
      load_vec<T, VEC>(a.residual + row * a.residual_stride + c, r);
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[i][e] = to_float(from_float<T>(v[i][e] + r[e]));
      store_vec<T, VEC>(a.sum + row * a.hidden + c, v[i]);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) ss += v[i][e] * v[i][e];
  }
  const float inv = rsqrtf(row_sum(ss, red) / a.hidden + a.eps);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = (threadIdx.x + i * blockDim.x) * VEC;
    if (!live || c >= a.hidden) continue;
    float w[VEC];
    load_vec<T, VEC>(a.weight + c, w);
#pragma unroll
    for (int e = 0; e < VEC; ++e) w[e] = __fmul_rn(__fmul_rn(v[i][e], inv), w[e]);
    store_vec<T, VEC>(a.y + row * a.hidden + c, w);
  }
}

// Smallest VPT (power of two) that fits the row in kMaxRowThreads threads; registers cap VEC * VPT at 8
// (8 floats a thread x 1024 threads = kMaxNormHidden; 16 spilled under the 64-register launch bound).
template <typename T, int VEC, bool ADD, int VPT = 1>
cudaError_t launch_with_vpt(const NormArgs<T>& a, cudaStream_t stream) {
  const int nvec = a.hidden / VEC;
  if constexpr (VEC * VPT < 8) {
    if (nvec > kMaxRowThreads * VPT) return launch_with_vpt<T, VEC, ADD, VPT * 2>(a, stream);
  }
  if (nvec > kMaxRowThreads * VPT) return cudaErrorInvalidValue;
  const int tpr = next_pow2((nvec + VPT - 1) / VPT);
  const int rows_per_cta = tpr >= kCtaThreads ? 1 : kCtaThreads / tpr;
  const int64_t grid = (a.rows + rows_per_cta - 1) / rows_per_cta;
  return launch_kernel(rms_norm_kernel<T, VEC, VPT, ADD>, dim3(grid), dim3(tpr, rows_per_cta), 0, stream, a);
}

template <bool ADD>
cudaError_t launch_norm(const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                        const void* weight, void* y, void* sum, int64_t rows, int64_t hidden, float eps,
                        ScalarType dtype, cudaStream_t stream) {
  if (rows < 0 || hidden <= 0 || hidden > kMaxNormHidden || rows > INT32_MAX) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const NormArgs<T> a{static_cast<const T*>(x), x_stride, static_cast<const T*>(residual), residual_stride,
                        static_cast<const T*>(weight), static_cast<T*>(y), static_cast<T*>(sum), rows,
                        static_cast<int>(hidden), eps};
    const int vec = vector_width<T>({x, residual, weight, y, sum}, {x_stride, residual_stride, hidden});
    constexpr int kVec = 16 / sizeof(T);
    return vec == kVec ? launch_with_vpt<T, kVec, ADD>(a, stream) : launch_with_vpt<T, 1, ADD>(a, stream);
  });
}

}  // namespace

cudaError_t launch_rms_norm(const void* x, int64_t x_row_stride, const void* weight, void* y, int64_t rows,
                            int64_t hidden, float eps, ScalarType dtype, cudaStream_t stream) {
  return launch_norm<false>(x, x_row_stride, nullptr, 0, weight, y, nullptr, rows, hidden, eps, dtype, stream);
}

cudaError_t launch_fused_add_rms_norm(const void* x, int64_t x_row_stride, const void* residual,
                                      int64_t residual_row_stride, const void* weight, void* y, void* sum,
                                      int64_t rows, int64_t hidden, float eps, ScalarType dtype, cudaStream_t stream) {
  return launch_norm<true>(x, x_row_stride, residual, residual_row_stride, weight, y, sum, rows, hidden, eps,
                           dtype, stream);
}

}  // namespace minillm
