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

Long prefill chunks leave the paged kernel for flash attention (the plan's prefill_sdpa and prefill_flash_varlen
verdicts, one threshold: kernels.prefill_sdpa_min_tokens queries; split_prefill routes each prefill sequence):
  a whole prompt (its query count equals its context length: a whole prompt, or a chunked prompt's first chunk; no
      prefix hit) runs on torch SDPA (flash), one call per such prompt, over its own k/v: this step's k/v where the
      write is not fused, else its blocks read back from the cache (qk_norm_rope stored them there);
  a chunk over a cached prefix (a later chunk of a chunked prompt, or a prefix-cache hit) runs on FlashAttention-2's
      variable-length forward (attention_ops.prefill_flash_varlen), all such chunks of the step in one call: their
      contexts are gathered from the paged cache into one contiguous K and V (FA2's paged mode needs pages of a
      multiple of 256 tokens, ours are 16 or 32), and FA2 aligns each chunk's causal mask to the bottom-right corner
      (query i of n sees the first L - n + i + 1 of its L keys), which is a chunk's position after its prefix;
  every other prefill sequence (short chunks, short prompts) runs on the paged kernel, one launch per run of
      adjacent ones (the launcher takes a range of sequences with contiguous rows; a step holds few chunks this long).
Flash measured 1.6-1.9x faster than the wide kernel on whole prompts of 4k-32k tokens; on chunks over a prefix an
SDPA call with an explicit mask over expanded K/V measured only 1.15x, hence the varlen op, which takes GQA and the
bottom-right mask natively (its speed there: scripts/prefill_bench.py). An fp8 cache never takes either route
(attention_ops.PREFILL_SDPA_COVERAGE, PREFILL_FLASH_VARLEN_COVERAGE): later chunks and decode steps read the
quantized k/v, so a prompt's own rows read them too. The cache write is unchanged either way.

The decode path does no host sync and sizes its split-K workspace from host-side maxima (meta.max_seq_len),
so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.ops import attention_ops as ops
from minillm.ops.kv_quant import is_fp8
from minillm.ops.reference import gather_kv_batch, gather_kv_ragged, ragged_kv_slots

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
        self.prefill_prefix_min_tokens = prefill_prefix_min_tokens   # the plan's prefill_flash_varlen threshold

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
            raise ValueError("prefill on flash attention reads native caches only, not fp8 ones "
                             "(PREFILL_SDPA_COVERAGE, PREFILL_FLASH_VARLEN_COVERAGE)")
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
        """Prefill sequences [nd, num_seqs): long whole prompts on SDPA, long chunks over a prefix on the varlen
        flash op (one call), the rest on the paged kernel."""
        if not (self.prefill_sdpa_min_tokens or self.prefill_prefix_min_tokens):
            route = PrefillRoute([], [], [(nd, meta.num_seqs, meta.max_query_len)])
        else:
            qsl, lens = meta.host_lists()
            route = split_prefill(qsl, lens, nd, meta.num_seqs, self.prefill_sdpa_min_tokens,
                                  self.prefill_prefix_min_tokens)
        for s in route.sdpa:
            lo, hi = qsl[s], qsl[s + 1]
            if k is not None:   # the write was not fused: this step's k/v are at hand
                kp, vp = k[lo:hi], v[lo:hi]
            else:               # qk_norm_rope stored them straight into the cache: read the prompt's blocks back
                kp, vp = (gather_kv_batch(c, meta.block_tables[s:s + 1], hi - lo)[0] for c in (k_cache, v_cache))
            out[lo:hi] = ops.prefill_sdpa(q[lo:hi], kp, vp, scale)
        if route.flash:
            batch = VarlenBatch.of(route.flash, qsl, lens, q.device)
            flash_varlen_prefill(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, batch, scale)
        for begin, end, max_query_len in route.runs:
            ops.paged_prefill(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              scale, max_query_len, seq_begin=begin, num_seqs=end - begin, k_scale=ks, v_scale=vs,
                              kernel=self.prefill_kernel)


class PrefillRoute(NamedTuple):
    sdpa: list[int]                     # whole prompts, one SDPA call each
    flash: list[int]                    # chunks over a prefix, one varlen flash call for all
    runs: list[tuple[int, int, int]]    # (first, last + 1, longest query): one paged-kernel launch each


def split_prefill(qsl: list[int], seq_lens: list[int], begin: int, end: int, min_tokens: int,
                  prefix_min_tokens: int = 0) -> PrefillRoute:
    """Route prefill sequences [begin, end) of a step (host query_start_loc and seq_lens): whole prompts of at
    least min_tokens tokens to SDPA, chunks over a prefix of at least prefix_min_tokens queries to the varlen flash
    op (0 turns either off), the runs of adjacent other sequences to the paged kernel, each run sized by its own
    longest query rather than the step's."""
    route, first, longest = PrefillRoute([], [], []), begin, 0
    for s in range(begin, end):
        n = qsl[s + 1] - qsl[s]
        whole = n == seq_lens[s]
        to = route.sdpa if whole and min_tokens and n >= min_tokens else \
            route.flash if not whole and prefix_min_tokens and n >= prefix_min_tokens else None
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


@dataclass(frozen=True)
class VarlenBatch:
    """The sequences of one varlen flash call: their indices in the step, their query rows, and the device offsets
    the op and the K/V gather read (one small host-to-device copy from pinned memory, so nothing syncs)."""
    seqs: torch.Tensor          # int64 [S]: the sequences' indices in the step's block_tables / seq_lens
    cu_q: torch.Tensor          # int32 [S + 1]: query offsets within the call
    cu_k: torch.Tensor          # int32 [S + 1]: key offsets within the gathered K/V
    rows: list[tuple[int, int]]   # host: each sequence's query rows in the step
    max_q: int
    max_k: int
    total_k: int                # host: the gathered K/V rows (the sum of the sequences' context lengths)

    @classmethod
    def of(cls, seqs: list[int], qsl: list[int], seq_lens: list[int], device) -> "VarlenBatch":
        q_lens = [qsl[s + 1] - qsl[s] for s in seqs]
        k_lens = [seq_lens[s] for s in seqs]
        host = torch.tensor([*seqs, *accumulate(q_lens, initial=0), *accumulate(k_lens, initial=0)], dtype=torch.int32)
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        n = len(seqs)
        return cls(dev[:n].long(), dev[n:2 * n + 1], dev[2 * n + 1:], [(qsl[s], qsl[s + 1]) for s in seqs],
                   max(q_lens), max(k_lens), sum(k_lens))

    @property
    def adjacent(self) -> bool:
        """The sequences' query rows are one contiguous range of the step's rows (one view, no copy)."""
        return all(a[1] == b[0] for a, b in zip(self.rows, self.rows[1:]))


def flash_varlen_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: VarlenBatch,
                         scale: float) -> None:
    """out[rows] = causal attention of the batch's query rows over their whole contexts, read from the paged
    cache (which already holds this step's k/v): the contexts gathered into one contiguous K and V, one call."""
    slots = ragged_kv_slots(block_tables.index_select(0, batch.seqs), seq_lens.index_select(0, batch.seqs),
                            batch.cu_k, batch.total_k, k_cache.shape[1])
    kg, vg = gather_kv_ragged(k_cache, slots), gather_kv_ragged(v_cache, slots)
    lo, hi = batch.rows[0][0], batch.rows[-1][1]
    qv = q[lo:hi] if batch.adjacent else torch.cat([q[a:b] for a, b in batch.rows])
    o = ops.prefill_flash_varlen(qv, kg, vg, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, scale)
    if batch.adjacent:
        out[lo:hi] = o
        return
    at = 0
    for a, b in batch.rows:
        out[a:b] = o[at:at + b - a]
        at += b - a
