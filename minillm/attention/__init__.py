"""Attention backends. Both share one interface:

    backend.fused_kv_write_target(qkv, num_heads, head_dim, k_cache, v_cache, meta) -> (k_cache, v_cache,
        slot_mapping) | None
    backend.forward(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale) -> out [T, Hq, D]

writing this step's k/v into the paged cache first, then attending through the block tables. Where the first
returns a target, the layer's qk_norm_rope kernel stores k/v straight into the cache and forward() gets k = v =
None (the CUDA backend on shapes its kernels cover; the torch backend never fuses).
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def resolve_attention(requested: str, device: torch.device) -> str:
    """'auto' -> 'cuda' on a GPU when the kernels build, else 'torch'. MINI_ENGINE_OPS=0 forces torch."""
    if os.environ.get("MINI_ENGINE_OPS", "1") == "0" or device.type != "cuda":
        if requested == "cuda" and device.type != "cuda":
            raise ValueError("attention='cuda' needs a CUDA device; use attention='torch' or 'auto' on the CPU")
        return "torch"
    if requested == "torch":
        return "torch"
    from minillm.ops.build import cuda_ops_available
    if cuda_ops_available():
        return "cuda"
    if requested == "cuda":
        raise RuntimeError("attention='cuda' was asked for but the CUDA extension could not be built")
    log.warning("CUDA kernels unavailable; falling back to the torch attention path")
    return "torch"


def make_attention_backend(requested: str, mode: str, device: torch.device):
    """Build the backend the runtime config asks for. MINI_ENGINE_ATTN=unified overrides the mode."""
    mode = os.environ.get("MINI_ENGINE_ATTN", mode)
    if resolve_attention(requested, device) == "cuda":
        from minillm.attention.cuda_backend import CudaAttentionBackend
        return CudaAttentionBackend(mode=mode)
    from minillm.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
