// The grammar bitmask applied to float32 logits (cuda/grammar_mask.cu; torch reference:
// minillm/sampling/grammar_mask.py apply_grammar_mask).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace minillm {

// logits: float32 [*, row_stride], written in place: column c of bitmask row r is allowed when bit c % 32 of
// word c / 32 is set, and a forbidden column becomes -inf in logits row rows[r] (rows == nullptr: row r).
// bitmask: int32 [num_rows, words], words >= ceil(vocab / 32). Columns at or past vocab are never touched.
cudaError_t launch_grammar_mask(float* logits, int64_t row_stride, const int32_t* bitmask, int64_t words,
                                const int64_t* rows, int64_t num_rows, int64_t vocab, cudaStream_t stream);

// Blocks `stream` until *flag (a device pointer to mapped host memory) equals expect or -expect (> 0), or until
// timeout_ns has passed; writes 0, 2 (it read -expect) or 1 (timed out) to the device int32 *status.
cudaError_t launch_wait_host_flag(const int64_t* flag, int64_t expect, int64_t timeout_ns, int32_t* status,
                                  cudaStream_t stream);

// Queues on `stream`: tokens[0, n) (device int64) into dst (a device pointer to mapped host memory), then value into
// *flag (likewise), visible to the host in that order.
cudaError_t launch_publish_host_tokens(const int64_t* tokens, int64_t n, int64_t* dst, int64_t* flag, int64_t value,
                                       cudaStream_t stream);

}  // namespace minillm
