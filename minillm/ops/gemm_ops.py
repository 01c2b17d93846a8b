"""Decode-sized linear layers: y = x @ weight.T (+ bias) through our small-M GEMM kernel or F.linear.

`linear()` is a drop-in for torch.nn.functional.linear. On a CUDA tensor, when the extension is built and the
shapes suit the kernel (see `unsupported_reason`), it runs torch.ops.minillm.small_m_linear
(cuda/small_m_gemm.cu): bf16/fp16, M <= MAX_M rows, weights streamed in before the kernel waits for the previous
one (programmatic dependent launch). Everything else, and every CPU tensor, goes to F.linear.

The kernel's split-K tile counters are a persistent int32 buffer per device, allocated here once (zeros) and
kept zero by the kernel itself, so the op needs no memset and can be captured in a CUDA graph. The first call
on a device must not happen inside a capture (it allocates the buffer); inside one, linear() then falls back to
F.linear. Kernels sharing the buffer must not run concurrently on different streams.

MINILLM_SMALL_M_GEMM=0 turns the kernel off (A/B timing); set_small_m_gemm(True/False/None) forces it on/off or
back to automatic (tests).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from minillm.ops.build import CudaOpSwitch, load_extension

MAX_M = 256          # rows (tokens) the kernel takes: cuda/gemm.h kSmallMMaxM
TILE_N = 64          # N must be a multiple of this
TILE_K = 64          # K must be a multiple of this
DTYPES = (torch.bfloat16, torch.float16)
# Split-K tile counters per device: the kernel needs one per (64-row weight tile x token tile) of a split
# launch (at most 2,374 x 4 for a 151,936-row lm_head); 256 KB, sized once so that no captured launch allocates.
NUM_COUNTERS = 1 << 16
# The largest variant opts in to 144 KB of dynamic shared memory (A100: 163 KB, H100/H200: 227 KB).
MIN_SMEM_OPTIN = 144 * 1024 + 1024

# Whether the LM head (N = vocab, M = sampled rows) also takes the kernel; MINILLM_SMALL_M_LM_HEAD=0 keeps it on
# cuBLAS, for A/B timings.
LM_HEAD = os.environ.get("MINILLM_SMALL_M_LM_HEAD", "1").strip() != "0"

_switch = CudaOpSwitch("small_m_linear")
_counters: dict[torch.device, torch.Tensor] = {}


def set_small_m_gemm(enabled: bool | None) -> None:
    """Force the kernel on (True: skips the environment check and the extension probe) or off (False), or back
    to automatic (None: MINILLM_SMALL_M_GEMM, then whether the extension has the op)."""
    _switch.set(enabled)


def env_enabled() -> bool:
    """MINILLM_SMALL_M_GEMM=0 turns the kernel off; anything else (or unset) leaves it on. Read per call."""
    return os.environ.get("MINILLM_SMALL_M_GEMM", "1").strip() != "0"


@lru_cache(maxsize=16)
def _device_ok(index: int) -> bool:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin is not None:
        return props.major >= 8 and optin >= MIN_SMEM_OPTIN
    return (props.major, props.minor) in ((8, 0), (9, 0))


def unsupported_reason(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot take x2 [M, K] @ weight[N, K].T (+ bias), or None when it can. Device-agnostic
    shape / dtype / layout rules only (the CPU tests check them); `supports` adds the device checks."""
    if x2.dtype not in DTYPES:
        return f"dtype {x2.dtype} (bfloat16/float16 only)"
    if weight.dtype != x2.dtype or (bias is not None and bias.dtype != x2.dtype):
        return "x, weight and bias dtypes differ"
    if x2.dim() != 2 or weight.dim() != 2:
        return "x must be [M, K] and weight [N, K]"
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        return f"K mismatch: x has {k}, weight has {weight.shape[1]}"
    if m > MAX_M:
        return f"M = {m} > {MAX_M}"
    if k == 0 or k % TILE_K or n == 0 or n % TILE_N:
        return f"N = {n} and K = {k} must be positive multiples of {TILE_N} / {TILE_K}"
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        return "weight must be contiguous and 16-byte aligned"
    if x2.stride(1) != 1 or (m > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16:
        return "x rows must be contiguous, 16-byte aligned, with a row stride that is a multiple of 8"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_contiguous()):
        return f"bias must be contiguous [{n}]"
    return None


def _kernel_on(x: torch.Tensor) -> bool:
    """Device side of the dispatch: CUDA tensor, kernel not switched off, extension has the op, device fits."""
    if not x.is_cuda:
        return False
    if _switch.enabled is None and not env_enabled():
        return False
    return _switch(x) and _device_ok(x.device.index)


def _kernel_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x as [M, K] rows when the kernel takes this call, else None."""
    if x.dim() == 0 or not _kernel_on(x):
        return None
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if unsupported_reason(x2, weight, bias) is None else None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True when linear(x, weight, bias) runs the small-M kernel (x may be [..., K])."""
    return _kernel_rows(x, weight, bias) is not None


def counters(device: torch.device | str | int) -> torch.Tensor:
    """The split-K tile counters of a CUDA device (allocated, zeroed, on first use; not inside a capture)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _counters.get(device)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("small_m_linear: the tile counters of a device are allocated on its first call, which "
                               "must not be inside a CUDA-graph capture; call linear() once eagerly first")
        buf = _counters[device] = torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
    return buf


def small_m_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile_m: int = 0,
                   split_k: int = 0) -> torch.Tensor:
    """The kernel itself, no fallback: x2 [M, K] CUDA, see unsupported_reason. tile_m (64/128/256) and split_k
    (1..16) force the launch shape (0 = the launcher's heuristic); for tests and the sweep."""
    return load_extension().small_m_linear(x2, weight, bias, counters(x2.device), int(tile_m), int(split_k))


def plan(m: int, n: int, k: int, num_sms: int, tile_m: int = 0, split_k: int = 0) -> dict[str, int]:
    """The launch the kernel makes for these sizes (tile_m, split_k, grid, smem_bytes, workspace_floats)."""
    p = load_extension().small_m_linear_plan(m, n, k, num_sms, NUM_COUNTERS, tile_m, split_k)
    keys = ("tile_m", "split_k", "grid_x", "grid_y", "grid_z", "smem_bytes", "workspace_floats", "counters")
    return dict(zip(keys, p))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as F.linear(x, weight, bias) (x [..., K], weight [N, K]); the small-M kernel when it fits."""
    x2 = _kernel_rows(x, weight, bias)
    # A device's first call allocates its counters, which a CUDA-graph capture must not do: F.linear then.
    if x2 is not None and (x.device in _counters or not torch.cuda.is_current_stream_capturing()):
        y = load_extension().small_m_linear(x2, weight, bias, counters(x.device), 0, 0)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
