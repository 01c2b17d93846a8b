"""Attention on the CUDA kernels: KV write, then paged decode / paged prefill into one output tensor.

The KV write is normally fused into the layer's qk_norm_rope kernel (see fused_kv_write_target); forward()
then gets k = v = None and launches only the attention kernels.

mode "split":   decode rows [0, num_decodes) go to the decode kernel (v1 or split-K, chosen by the
                dispatcher), prefill rows to the tensor-core prefill kernel; both write slices of one output.
mode "unified": every row goes through the prefill kernel (a decode row is a prefill chunk of length 1),
                kept for comparison.
Shapes the kernels do not cover (head dim other than 64/128, GQA group above 8, block size other than 16/32,
dtypes other than bf16/fp16) warn once and run on the torch backend: never a wrong answer.

An fp8 cache (the KVCacheSpec's dtype): the KV write (fused or not) quantizes and the decode and prefill kernels
read fp8, all with the layer's scales from the spec (minillm/ops/kv_quant.py FP8_KERNEL_COVERAGE).

The decode path does no host sync and sizes its split-K workspace from host-side maxima (meta.max_seq_len),
so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.ops import attention_ops as ops
from minillm.ops.kv_quant import is_fp8

MODES = ("split", "unified")
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (16, 32)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_GQA_GROUP = 16   # the decode kernel puts a group's query heads in the 16 rows of an mma tile


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the CUDA kernels cannot run this shape/dtype, or None when they can."""
    return _reason(q.is_cuda, q.shape[-1], q.shape[1], k_cache.shape[2], k_cache.shape[1], q.dtype, k_cache.dtype)


# Asked for every layer of every eager step with the same few arguments: memoised on them.
@lru_cache(maxsize=64)
def _reason(is_cuda: bool, head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int,
            dtype: torch.dtype, cache_dtype: torch.dtype) -> str | None:
    if not is_cuda:
        return "tensors are not on a CUDA device"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block_size={block_size} (supported: {SUPPORTED_BLOCK_SIZES})"
    if dtype not in SUPPORTED_DTYPES or not (cache_dtype == dtype or is_fp8(cache_dtype)):
        return f"dtype q={dtype} cache={cache_dtype} (supported: bfloat16, float16; the cache the same or fp8)"
    if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= MAX_GQA_GROUP:
        return f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads} (group must be 1..{MAX_GQA_GROUP})"
    return None


class CudaAttentionBackend:
    name = "cuda"

    def __init__(self, mode: str = "split", *, min_partitions: int = ops.MIN_PARTITIONS,
                 ctas_per_sm: int = ops.CTAS_PER_SM_TARGET, fuse_kv_write: bool = True):
        if mode not in MODES:
            raise ValueError(f"attention mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.min_partitions, self.ctas_per_sm = min_partitions, ctas_per_sm
        self.fuse_kv_write = fuse_kv_write   # the model's qk_norm_rope runs its kernel (KernelChoice.cuda)
        self.kv_spec = None
        self._fallback = None
        self._warned: set[str] = set()

    def bind_kv_cache(self, spec) -> None:
        """The engine's KVCacheSpec (minillm/cache/spec.py). A layout the kernels do not read is refused here, once,
        rather than discovered per call."""
        if spec.layout != "nhd":
            raise ValueError(f"the CUDA attention kernels read the 'nhd' KV layout, not {spec.layout!r}")
        self.kv_spec = spec
        if self._fallback is None:
            self._fallback = _torch_backend()
        self._fallback.bind_kv_cache(spec)

    def fused_kv_write_target(self, qkv: torch.Tensor, num_heads: int, head_dim: int, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slot_mapping) for qk_norm_rope to store this step's k/v into, or None.

        Only when forward() will take the kernel path for this shape (the torch fallback writes the cache from
        k/v itself), and only when qk_norm_rope runs its CUDA kernel (fuse_kv_write): its torch path could write
        the cache too, but slower than kv_write, so fusing there would cost instead of save.
        """
        if not self.fuse_kv_write:
            return None
        # The checks forward() will make on q as qk_norm_rope returns it ([T, num_heads, head_dim], qkv's dtype).
        reason = _reason(qkv.is_cuda, head_dim, num_heads, k_cache.shape[2], k_cache.shape[1], qkv.dtype,
                         k_cache.dtype)
        if reason is not None:
            return None
        if is_fp8(k_cache.dtype):
            return (k_cache, v_cache, meta.slot_mapping, *self.kv_spec.layer_scales(k_cache))
        return k_cache, v_cache, meta.slot_mapping

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D] in q's dtype (rows past meta.num_tokens unset).
        k = v = None: the cache already holds this step's k/v (qk_norm_rope wrote it, fused_kv_write_target)."""
        reason = unsupported_reason(q, k_cache)
        if reason is not None:
            return self._torch_forward(reason, q, k, v, k_cache, v_cache, meta, scale)
        fp8 = is_fp8(k_cache.dtype)
        ks, vs = self.kv_spec.layer_scales(k_cache) if fp8 else (None, None)
        if k is not None:
            ops.kv_write(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        out = torch.empty_like(q)
        nd = meta.num_decodes if self.mode == "split" else 0
        if nd > 0:
            ops.paged_decode(out[:nd], q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                             scale, meta.max_seq_len, min_partitions=self.min_partitions,
                             ctas_per_sm=self.ctas_per_sm, k_scale=ks, v_scale=vs)
        if meta.num_seqs > nd:
            ops.paged_prefill(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              scale, meta.max_query_len, seq_begin=nd, num_seqs=meta.num_seqs - nd,
                              k_scale=ks, v_scale=vs)
        return out

    def _torch_forward(self, reason: str, *args) -> torch.Tensor:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"CUDA attention kernels do not cover {reason}; using the torch backend", stacklevel=3)
        if self._fallback is None:
            self._fallback = _torch_backend()
        return self._fallback.forward(*args)


def _torch_backend():
    from minillm.attention.torch_backend import TorchAttentionBackend   # lazy: only for uncovered shapes

    return TorchAttentionBackend()
