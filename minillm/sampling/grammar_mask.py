"""Applying a grammar's token bitmask to the logits, on the logits' device, with no host sync.

The bitmask is xgrammar's layout: int32 words, bit j of word w allows token 32 * w + j (0 = masked). Only the
constrained rows carry one; a batch without any has no GrammarMask at all, so unconstrained batches pay nothing.
On CUDA (when the sampler's kernels run) one kernel (cuda/grammar_mask.cu) writes -inf into the forbidden
logits in place. The torch path below, the kernel's reference, unpacks the words as little-endian bytes into a
bool [M, V] and fills masked logits with -inf: several elementwise passes over M x V bytes, and an
index_select / index_copy pair when only some rows are constrained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minillm.ops.sampling_ops import allowed_tokens  # noqa: F401 - the bitmask layout lives with the kernels


@dataclass
class GrammarMask:
    bitmask: torch.Tensor            # int32 [M, ceil(V / 32)] on the logits' device
    rows: torch.Tensor | None        # int64 [M]: the constrained rows, ascending; None = every row, in order


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask, cuda: bool = False) -> None:
    """logits [N, V] (modified in place): every token a constrained row's grammar forbids becomes -inf.
    cuda: the kernel may run (float32 CUDA logits only; anything else takes the torch path)."""
    if cuda and logits.is_cuda and logits.dtype == torch.float32 and logits.stride(1) == 1:
        torch.ops.minillm.grammar_mask_(logits, mask.bitmask.contiguous(), mask.rows)
        return
    forbidden = ~allowed_tokens(mask.bitmask, logits.shape[1])
    if mask.rows is None:
        logits.masked_fill_(forbidden, -math.inf)
        return
    sub = logits.index_select(0, mask.rows)
    sub.masked_fill_(forbidden, -math.inf)
    logits.index_copy_(0, mask.rows, sub)


def wait_for_host_flag(status: torch.Tensor, flag_addr: int, expect: int, timeout_s: float) -> None:
    """Make the current CUDA stream wait until the int64 at host address `flag_addr` (pinned or registered
    memory, see register_host_memory) holds `expect` or -`expect` (> 0), or `timeout_s` has passed; status (int32
    CUDA [1]) gets 0, 2 (it read -expect) or 1 (timed out). Work queued after it reads what the host stored before
    the flag. Nothing on the host waits."""
    torch.ops.minillm.wait_host_flag_(status, flag_addr, expect, max(1, int(timeout_s * 1e9)))


def publish_host_tokens(tokens: torch.Tensor, dst_addr: int, flag_addr: int, value: int) -> None:
    """Queue on the current CUDA stream: int64 CUDA `tokens` [n] into the int64 [n] at host address `dst_addr`,
    then `value` into the int64 at `flag_addr` (both in mapped memory: register_host_memory). A host reader that
    sees the flag sees the tokens (wait_for_host_flag's counterpart)."""
    torch.ops.minillm.publish_host_tokens_(tokens.contiguous(), dst_addr, flag_addr, value)


def register_host_memory(addr: int, nbytes: int) -> None:
    """Page-lock and map host memory that torch did not allocate (a shared-memory segment), so that copies
    from it run asynchronously and wait_for_host_flag can poll a flag in it."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(addr, nbytes, _REGISTER_PORTABLE_MAPPED))


def unregister_host_memory(addr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(addr))


_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02   # cudaHostRegisterPortable | cudaHostRegisterMapped
