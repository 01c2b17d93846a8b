// Torch binding of the grammar-bitmask kernel (cuda/grammar_mask.cu): writes -inf into forbidden logits in place.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "bindings_util.h"
#include "grammar_mask.h"

namespace {

using at::Tensor;

// logits: float32 CUDA [N, V] with unit column stride; bitmask: int32 [M, >= ceil(V / 32)] contiguous on the same
// device; rows: int64 [M] indices into logits' rows, or None for rows 0..M-1 (then M <= N).
void grammar_mask_(Tensor& logits, const Tensor& bitmask, const std::optional<Tensor>& rows) {
  MINILLM_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
                "logits must be a float32 CUDA tensor [N, V] with unit column stride, got ", logits.sizes(), " ",
                logits.scalar_type(), " on ", logits.device());
  MINILLM_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                    bitmask.device() == logits.device(),
                "bitmask must be contiguous int32 [M, words] on logits' device, got ", bitmask.sizes(), " ",
                bitmask.scalar_type(), " on ", bitmask.device());
  const int64_t num_rows = bitmask.size(0), words = bitmask.size(1), vocab = logits.size(1);
  MINILLM_CHECK(words * 32 >= vocab, "bitmask has ", words, " words a row, fewer than the ", vocab,
                " logits need");
  MINILLM_CHECK(num_rows <= 65535, "bitmask has ", num_rows, " rows, more than 65535");
  const int64_t* row_ptr = nullptr;
  if (rows.has_value()) {
    MINILLM_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->size(0) == num_rows &&
                      rows->is_contiguous() && rows->device() == logits.device(),
                  "rows must be contiguous int64 [", num_rows, "] on logits' device, got ", rows->sizes(), " ",
                  rows->scalar_type());
    row_ptr = rows->data_ptr<int64_t>();
  } else {
    MINILLM_CHECK(num_rows <= logits.size(0), "bitmask has ", num_rows, " rows, logits only ", logits.size(0));
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t err = minillm::launch_grammar_mask(logits.data_ptr<float>(), logits.stride(0),
                                                       bitmask.data_ptr<int32_t>(), words, row_ptr, num_rows, vocab,
                                                       at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, minillm::bindings::msg("minillm.grammar_mask_: CUDA error ",
                                                         cudaGetErrorString(err)));
}

// The device address of host memory that cudaHostRegister mapped (or pinned memory), or a clear error.
void* mapped_device_pointer(int64_t addr, const char* op, const char* what) {
  void* dev = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(addr), 0);
  TORCH_CHECK(err == cudaSuccess, minillm::bindings::msg(op, ": ", what, " is not in mapped host memory: ",
                                                         cudaGetErrorString(err)));
  return dev;
}

// status: int32 CUDA [1]; flag_addr: the host address of an int64 in pinned or cudaHostRegister'ed (mapped) memory.
void wait_host_flag_(Tensor& status, int64_t flag_addr, int64_t expect, int64_t timeout_ns) {
  MINILLM_CHECK(status.is_cuda() && status.scalar_type() == at::kInt && status.numel() == 1,
                "status must be an int32 CUDA tensor of one element, got ", status.sizes(), " ",
                status.scalar_type(), " on ", status.device());
  MINILLM_CHECK(expect > 0 && timeout_ns > 0, "expect and timeout_ns must be positive, got ", expect, " and ",
                timeout_ns);
  const c10::cuda::CUDAGuard guard(status.device());
  void* dev = mapped_device_pointer(flag_addr, "minillm.wait_host_flag_", "the flag");
  const cudaError_t err = minillm::launch_wait_host_flag(static_cast<const int64_t*>(dev), expect, timeout_ns,
                                                         status.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, minillm::bindings::msg("minillm.wait_host_flag_: CUDA error ",
                                                         cudaGetErrorString(err)));
}

// tokens: contiguous int64 CUDA [n]; dst_addr / flag_addr: host addresses of int64 [n] / int64 in mapped memory.
void publish_host_tokens_(const Tensor& tokens, int64_t dst_addr, int64_t flag_addr, int64_t value) {
  MINILLM_CHECK(tokens.is_cuda() && tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.is_contiguous(),
                "tokens must be a contiguous int64 CUDA tensor [n], got ", tokens.sizes(), " ", tokens.scalar_type(),
                " on ", tokens.device());
  const c10::cuda::CUDAGuard guard(tokens.device());
  const char* op = "minillm.publish_host_tokens_";
  auto* dst = static_cast<int64_t*>(mapped_device_pointer(dst_addr, op, "the token buffer"));
  auto* flag = static_cast<int64_t*>(mapped_device_pointer(flag_addr, op, "the flag"));
  const cudaError_t err = minillm::launch_publish_host_tokens(tokens.data_ptr<int64_t>(), tokens.numel(), dst, flag,
                                                              value, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, minillm::bindings::msg(op, ": CUDA error ", cudaGetErrorString(err)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, m) {
  m.def("grammar_mask_(Tensor(a!) logits, Tensor bitmask, Tensor? rows) -> ()");
  m.def("wait_host_flag_(Tensor(a!) status, int flag_addr, int expect, int timeout_ns) -> ()");
  m.def("publish_host_tokens_(Tensor tokens, int dst_addr, int flag_addr, int value) -> ()");
}

TORCH_LIBRARY_IMPL(minillm, CUDA, m) {
  m.impl("grammar_mask_", &grammar_mask_);
  m.impl("wait_host_flag_", &wait_host_flag_);
  m.impl("publish_host_tokens_", &publish_host_tokens_);
}
