"""Attention backends. Both share one interface:

    backend.fused_kv_write_target(qkv, num_heads, head_dim, k_cache, v_cache, meta) -> (k_cache, v_cache,
        slot_mapping) | None
    backend.forward(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale) -> out [T, Hq, D]

writing this step's k/v into the paged cache first, then attending through the block tables. Where the first
returns a target, the layer's qk_norm_rope kernel stores k/v straight into the cache and forward() gets k = v =
None (the CUDA backend where the engine's plan fuses it; the torch backend never fuses).
"""
from __future__ import annotations


def make_attention_backend(name: str, *, mode: str = "split", min_partitions: int = 1, ctas_per_sm: int = 2,
                           fuse_kv_write: bool = False, prefill_kernel: str | None = None,
                           prefill_sdpa_min_tokens: int = 0, prefill_prefix_min_tokens: int = 0):
    """The backend the engine's ExecutionPlan (minillm/runner/plan.py) names: "cuda" (its kernels cover the model
    and cache, decided there) or "torch"."""
    if name == "cuda":
        from minillm.attention.cuda_backend import CudaAttentionBackend
        return CudaAttentionBackend(mode=mode, min_partitions=min_partitions, ctas_per_sm=ctas_per_sm,
                                    fuse_kv_write=fuse_kv_write, prefill_kernel=prefill_kernel,
                                    prefill_sdpa_min_tokens=prefill_sdpa_min_tokens,
                                    prefill_prefix_min_tokens=prefill_prefix_min_tokens)
    from minillm.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
