// The element type of a kernel's tensors: the one code every launcher takes (the bindings map torch dtypes to it).
#pragma once

namespace minillm {

enum class ScalarType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace minillm
