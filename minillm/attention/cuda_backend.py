"""Attention on the CUDA kernels: KV write, then paged decode / paged prefill into one output tensor.

The KV write is normally fused into the layer's qk_norm_rope kernel (see fused_kv_write_target); forward()
then gets k = v = None and launches only the attention kernels.

mode "split":   decode rows [0, num_decodes) go to the decode kernel (v1 or split-K, chosen by the
                dispatcher), prefill rows to the tensor-core prefill kernel; both write slices of one output.
mode "unified": every row goes through the prefill kernel (a decode row is a prefill chunk of length 1),
                kept for comparison.
Which shapes the kernels cover is declared once (minillm/ops/attention_ops.py: COVERAGE); the engine's plan
(minillm/runner/plan.py) builds this backend only where they do, so forward() makes no per-call decision.
bind_kv_cache refuses a cache outside the coverage once, at start-up; the C++ launchers check again.

An fp8 cache (the KVCacheSpec's dtype): the KV write (fused or not) quantizes and the decode and prefill kernels
read fp8, all with the layer's scales from the spec (minillm/ops/kv_quant.py FP8_KERNEL_COVERAGE).

Long prefill chunks leave the paged kernel for cuDNN's fused attention (the plan's prefill_sdpa and
prefill_sdpa_prefix verdicts, one threshold: kernels.prefill_sdpa_min_tokens queries; split_prefill routes each
prefill sequence), one attention_ops.prefill_cudnn call per such sequence over its context:
  a whole prompt (its query count equals its context length: a whole prompt, or a chunked prompt's first chunk; no
      prefix hit) over its own k/v: this step's k/v where the write is not fused, else its blocks read back from
      the cache (qk_norm_rope stored them there);
  a chunk over a cached prefix (a later chunk of a chunked prompt, or a prefix-cache hit) over its whole context
      read back from the paged cache (which already holds this step's k/v);
  every other prefill sequence (short chunks, short prompts) runs on the paged kernel, one launch per run of
      adjacent ones (the launcher takes a range of sequences with contiguous rows; a step holds few chunks this long).
Why cuDNN and how fast: attention_ops.PREFILL_SDPA_COVERAGE. An fp8 cache never takes it: later chunks and decode
steps read the quantized k/v, so a prompt's own rows read them too. The cache write is unchanged either way.

The decode path does no host sync and sizes its split-K workspace from host-side maxima (meta.max_seq_len),
so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.ops import attention_ops as ops
from minillm.ops.kv_quant import is_fp8
from minillm.ops.reference import gather_kv_batch

MODES = ("split", "unified")


class CudaAttentionBackend:
    name = "cuda"

    def __init__(self, mode: str = "split", *, min_partitions: int = ops.MIN_PARTITIONS,
                 ctas_per_sm: int = ops.CTAS_PER_SM_TARGET, fuse_kv_write: bool = True,
                 prefill_kernel: str | None = None, prefill_sdpa_min_tokens: int = 0,
                 prefill_prefix_min_tokens: int = 0):
        if mode not in MODES:
            raise ValueError(f"attention mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.min_partitions, self.ctas_per_sm = min_partitions, ctas_per_sm
        self.fuse_kv_write = fuse_kv_write   # the plan's fused_kv_write verdict: qk_norm_rope stores k/v
        self.kv_spec = None
        self.prefill_kernel = prefill_kernel   # the plan's choice for the engine's cache; None: per call
        self.prefill_sdpa_min_tokens = prefill_sdpa_min_tokens   # the plan's prefill_sdpa threshold; 0: off
        self.prefill_prefix_min_tokens = prefill_prefix_min_tokens   # the plan's prefill_sdpa_prefix threshold

    def bind_kv_cache(self, spec) -> None:
        """The engine's KVCacheSpec (minillm/cache/spec.py). A layout or shape the kernels do not read is refused
        here, once (the plan never builds this backend for one), rather than discovered per call."""
        if spec.layout != "nhd":
            raise ValueError(f"the CUDA attention kernels read the 'nhd' KV layout, not {spec.layout!r}")
        kv_dtype = str(spec.dtype).removeprefix("torch.")
        dtype = ops.COVERAGE.dtypes[0] if is_fp8(spec.dtype) else kv_dtype   # an fp8 cache serves either
        reason = ops.COVERAGE.reason(dtype=dtype, capability=ops.COVERAGE.min_capability, head_dim=spec.head_dim,
                                     block_size=spec.block_size, kv_dtype=kv_dtype)
        if reason is not None:
            raise ValueError(f"the CUDA attention kernels do not cover this KV cache: {reason}")
        if (self.prefill_sdpa_min_tokens or self.prefill_prefix_min_tokens) and is_fp8(spec.dtype):
            raise ValueError("prefill on cuDNN attention reads native caches only, not fp8 ones "
                             "(PREFILL_SDPA_COVERAGE)")
        self.kv_spec = spec

    def fused_kv_write_target(self, qkv: torch.Tensor, num_heads: int, head_dim: int, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slot_mapping) for qk_norm_rope to store this step's k/v into, or None.

        Where the plan fused the write (fuse_kv_write: qk_norm_rope runs its CUDA kernel; its torch path could
        write the cache too, but slower than kv_write, so fusing there would cost instead of save).
        """
        if not self.fuse_kv_write:
            return None
        if is_fp8(k_cache.dtype):
            return (k_cache, v_cache, meta.slot_mapping, *self.kv_spec.layer_scales(k_cache))
        return k_cache, v_cache, meta.slot_mapping

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D] in q's dtype (rows past meta.num_tokens unset).
        k = v = None: the cache already holds this step's k/v (qk_norm_rope wrote it, fused_kv_write_target)."""
        ks, vs = self.kv_spec.layer_scales(k_cache) if is_fp8(k_cache.dtype) else (None, None)
        if k is not None:
            ops.kv_write(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        out = torch.empty_like(q)
        nd = meta.num_decodes if self.mode == "split" else 0
        if nd > 0:
            ops.paged_decode(out[:nd], q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                             scale, meta.max_seq_len, min_partitions=self.min_partitions,
                             ctas_per_sm=self.ctas_per_sm, k_scale=ks, v_scale=vs)
        if meta.num_seqs > nd:
            self._prefill(out, q, k, v, k_cache, v_cache, meta, scale, nd, ks, vs)
        return out

    def _prefill(self, out, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, nd: int, ks, vs):
        """Prefill sequences [nd, num_seqs): long whole prompts and long chunks over a prefix on cuDNN, one call
        each, the rest on the paged kernel."""
        if not (self.prefill_sdpa_min_tokens or self.prefill_prefix_min_tokens):
            route = PrefillRoute([], [], [(nd, meta.num_seqs, meta.max_query_len)])
        else:
            qsl, lens = meta.host_lists()
            route = split_prefill(qsl, lens, nd, meta.num_seqs, self.prefill_sdpa_min_tokens,
                                  self.prefill_prefix_min_tokens)
        for s in route.whole:
            lo, hi = qsl[s], qsl[s + 1]
            if k is not None:   # the write was not fused: this step's k/v are at hand
                kp, vp = k[lo:hi], v[lo:hi]
            else:               # qk_norm_rope stored them straight into the cache: read the prompt's blocks back
                kp, vp = (gather_kv_batch(c, meta.block_tables[s:s + 1], hi - lo)[0] for c in (k_cache, v_cache))
            out[lo:hi] = ops.prefill_cudnn(q[lo:hi], kp, vp, scale)
        for s in route.prefixed:
            lo, hi = qsl[s], qsl[s + 1]
            kp, vp = (gather_kv_batch(c, meta.block_tables[s:s + 1], lens[s])[0] for c in (k_cache, v_cache))
            out[lo:hi] = ops.prefill_cudnn(q[lo:hi], kp, vp, scale)
        for begin, end, max_query_len in route.runs:
            ops.paged_prefill(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              scale, max_query_len, seq_begin=begin, num_seqs=end - begin, k_scale=ks, v_scale=vs,
                              kernel=self.prefill_kernel)


class PrefillRoute(NamedTuple):
    whole: list[int]                    # whole prompts, one cuDNN call each
    prefixed: list[int]                 # chunks over a cached prefix, one cuDNN call each
    runs: list[tuple[int, int, int]]    # (first, last + 1, longest query): one paged-kernel launch each


def split_prefill(qsl: list[int], seq_lens: list[int], begin: int, end: int, min_tokens: int,
                  prefix_min_tokens: int = 0) -> PrefillRoute:
    """Route prefill sequences [begin, end) of a step (host query_start_loc and seq_lens): whole prompts of at
    least min_tokens tokens and chunks over a prefix of at least prefix_min_tokens queries to cuDNN (0 turns either
    off), the runs of adjacent other sequences to the paged kernel, each run sized by its own longest query rather
    than the step's."""
    route, first, longest = PrefillRoute([], [], []), begin, 0
    for s in range(begin, end):
        n = qsl[s + 1] - qsl[s]
        whole = n == seq_lens[s]
        to = route.whole if whole and min_tokens and n >= min_tokens else \
            route.prefixed if not whole and prefix_min_tokens and n >= prefix_min_tokens else None
        if to is None:
            longest = max(longest, n)
            continue
        if s > first:
            route.runs.append((first, s, longest))
        to.append(s)
        first, longest = s + 1, 0
    if end > first:
        route.runs.append((first, end, longest))
    return route
