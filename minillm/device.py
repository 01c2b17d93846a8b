"""Device and dtype resolution, and the one way the engine copies host arrays to the device."""
from __future__ import annotations

import numpy as np
import torch

from minillm.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: torch.device | str) -> torch.device:
    """'auto' = the GPU when there is one, else the CPU; asking for CUDA without a GPU is a config error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device={str(device)!r} is not available: no CUDA GPU found; use cpu or auto")
    return device


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """'auto' = bfloat16 on a GPU, float32 on the CPU (CPU bf16 matmuls are slow and only emulated)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is not allowed: one of {', '.join(DTYPES)}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device tensor without waiting for the GPU.

    A copy from pageable memory may synchronise with the stream, which would stall a step launched while
    the previous one still runs (async scheduling); staging through pinned memory from torch's caching host
    allocator keeps it asynchronous, and that allocator keeps the buffer alive until the copy is done.
    """
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
