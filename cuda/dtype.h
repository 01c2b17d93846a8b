// The element type of a kernel's tensors: the one code every launcher takes (the bindings map torch dtypes to it).
#pragma once

namespace minillm {

// The fp8 codes name KV-cache formats only (minillm/cuda/kv_fp8.cuh); no activation is fp8.
enum class ScalarType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3, kFloat8E5M2 = 4 };

}  // namespace minillm
