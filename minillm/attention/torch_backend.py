"""Paged attention in plain PyTorch: the CPU path and the `kernels.backend=torch` path on a GPU. The math is the
kernels' reference itself (minillm/ops/reference.py): the KV write, then decode rows (one query each) attended
together in one batched call padded to the longest decode context, then each prefill chunk on its own. Scores,
softmax and the weighted sum run in fp32; the output takes q's dtype. An fp8 cache (the spec's dtype) is
quantized on write and dequantized on read with the layer's scales from the spec.
"""
from __future__ import annotations

import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.ops.coverage import KernelCoverage
from minillm.ops.reference import kv_write_ref, paged_attention_ref, paged_decode_ref

# Any head dim, GQA group and block size, on any device. Not graph-safe: each step's shapes (the longest context it
# pads to, the prefill chunks) come from host lists, read back from the device when the metadata lacks them.
COVERAGE = KernelCoverage("torch_attention", dtypes=("float32", "bfloat16", "float16"), min_capability=(0, 0),
                          graph_safe=False)
NOT_GRAPH_SAFE = ("the torch attention path sizes each step from the sequence lengths on the host (a device sync, "
                  "which CUDA-graph capture forbids)")


class TorchAttentionBackend:
    """forward(q [T,Hq,D], k/v [T,Hkv,D], k_cache, v_cache, meta, scale) -> [T, Hq, D] in q's dtype."""

    name = "torch"
    kv_spec = None

    def bind_kv_cache(self, spec) -> None:
        """The engine's KVCacheSpec (minillm/cache/spec.py): the layout and dtype of the caches forward() gets."""
        self.kv_spec = spec

    def fused_kv_write_target(self, *args) -> None:
        """Never fused: forward() writes the cache from k/v (see CudaAttentionBackend.fused_kv_write_target)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        n, nd = meta.num_tokens, meta.num_decodes
        ks, vs = self.kv_spec.layer_scales(k_cache) if self.kv_spec is not None else (None, None)
        kv_write_ref(k[:n], v[:n], k_cache, v_cache, meta.slot_mapping[:n], ks, vs)
        # Rows past num_tokens are CUDA-graph padding: they stay zero.
        out = torch.zeros_like(q)
        qsl, seq_lens = meta.host_lists()
        if nd:
            out[:nd] = paged_decode_ref(q[:nd], k_cache, v_cache, meta.block_tables[:nd], seq_lens[:nd], scale,
                                          ks, vs)
        if meta.num_seqs > nd:
            # Prefill rows only: the reference starts at the first prefill sequence's rows.
            lo = qsl[nd]
            rows = paged_attention_ref(q[lo:n], k_cache, v_cache, meta.block_tables[nd:], seq_lens[nd:],
                                       [x - lo for x in qsl[nd:]], scale, ks, vs)
            out[lo:n] = rows
        return out

