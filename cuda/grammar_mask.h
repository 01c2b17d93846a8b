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

}  // namespace minillm
