"""Attention backends. Both share one interface:

    backend.fused_kv_write_target(qkv, num_heads, head_dim, k_cache, v_cache, meta) -> (k_cache, v_cache,
        slot_mapping) | None
    backend.forward(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale) -> out [T, Hq, D]

writing this step's k/v into the paged cache first, then attending through the block tables. Where the first
returns a target, the layer's qk_norm_rope kernel stores k/v straight into the cache and forward() gets k = v =
None (the CUDA backend on shapes its kernels cover; the torch backend never fuses).
"""
from __future__ import annotations


def make_attention_backend(kernels):
    """The backend a KernelChoice (minillm/ops/choice.py) names."""
    if kernels.attention == "cuda":
        from minillm.attention.cuda_backend import CudaAttentionBackend
        return CudaAttentionBackend(mode=kernels.attention_mode, min_partitions=kernels.decode_min_partitions,
                                    ctas_per_sm=kernels.decode_ctas_per_sm, fuse_kv_write=kernels.cuda)
    from minillm.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
