"""FP8 KV cache arithmetic: the one definition of quantize-on-write and dequantize-on-read, which the torch path
runs and the CUDA kernels are checked against, plus which kernels accept an fp8 cache.

A cached value is stored as fp8(clamp(x * (1 / scale), -max, max)), max = 448 for e4m3fn and 57344 for e5m2, and
read back as float(fp8) * scale. `scale` is per (layer, KV head), separately for K and V (float32). The reciprocal
is taken once in fp32 and multiplied, the way the kernels do it, so the stored bytes agree bit for bit; the cast
rounds to nearest even. Values beyond the range saturate (inf included); NaN stays NaN, as it would in bf16.
"""
from __future__ import annotations

import torch

# cache.kv_cache_dtype values that store fp8 -> torch dtype. "fp8" means e4m3fn (what vLLM's "fp8" means).
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# Which kernels read and write an fp8 cache. The execution plan must not pick a False one for an fp8 spec (the
# persistent decode kernel reads bf16/fp16 caches only: an fp8 engine runs decode on the paged decode kernel).
FP8_KERNEL_COVERAGE = {
    "kv_write": True,            # minillm/cuda/kv_write.cu
    "qk_norm_rope_cache": True,  # minillm/cuda/fused_rope.cu (RoPE fused with the KV write)
    "paged_decode": True,        # minillm/cuda/paged_decode.cu (v1 and split-K)
    "paged_prefill": True,       # minillm/cuda/paged_prefill.cu (split and unified modes)
    "decode_megakernel": False,  # minillm/cuda/decode_megakernel.cu
    "torch": True,               # minillm/ops/reference.py, the torch attention backend
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., H, D] (any float dtype), scale [H] fp32 -> fp8 [..., H, D] of `dtype`, saturating."""
    inv = torch.reciprocal(scale.float().to(x.device))[:, None]
    limit = fp8_max(dtype)
    return (x.float() * inv).clamp(-limit, limit).to(dtype)


def dequantize(c: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache slice [..., H, D] -> fp32; scale None for an unquantised cache."""
    if scale is None:
        return c.float()
    return c.float() * scale.float().to(c.device)[:, None]


def unit_scales(num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """The default: scale 1.0 for every (layer, K/V, head), fp32 [layers, 2, Hkv]."""
    return torch.ones(num_layers, 2, num_kv_heads, dtype=torch.float32)


def kernels_refusing_fp8() -> list[str]:
    return sorted(k for k, ok in FP8_KERNEL_COVERAGE.items() if not ok)
