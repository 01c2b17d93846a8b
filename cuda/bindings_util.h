// Error messages of the torch bindings files (*_bindings.cpp): the only header here that includes torch, so the
// kernel sources never see it.
//
// Messages are assembled with std::to_string and handed to TORCH_CHECK as one string, which c10 passes through
// untouched. Streaming an integer into c10::str's ostringstream from this library crashed (SIGSEGV in
// basic_ostream::_M_insert<long>, resolved inside the .so) on the H200 image with torch 2.11.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace minillm::bindings {

inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
inline std::string text(int64_t v) { return std::to_string(v); }
inline std::string text(at::ScalarType t) { return c10::toString(t); }
inline std::string text(const c10::Device& d) { return d.str(); }
inline std::string text(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

template <typename... Parts>
std::string msg(const Parts&... parts) {
  return (std::string() + ... + text(parts));
}

}  // namespace minillm::bindings

// Raises ValueError with the concatenated message parts.
#define MINILLM_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, ::minillm::bindings::msg(__VA_ARGS__))
