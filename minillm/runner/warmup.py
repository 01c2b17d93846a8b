"""Warm the eager (prefill and mixed) step path at the token counts serving will meet, before serving.

The first time a GEMM shape comes up, cuBLAS may pick a kernel whose module is not loaded yet (CUDA loads
modules lazily) and the caching allocator may have to cudaMalloc new segments: a one-off stall of tens of
milliseconds inside some step, which every running request then sees as one long inter-token gap (the
latency sweep's itl_worst_s). Running each token count once at start-up moves those costs out of serving.
Decode-only steps replay CUDA graphs captured beforehand and need none of this. Long prefill chunks on cuDNN
compile a kernel variant the first time (~0.5-1 s on the H200): one chunk over a prefix compiles both. The
sampler's torch reductions load lazily too (the first isfinite over [64, 151936] bf16 logits took 132 ms on the
H200, the first argmax 12 ms, at c6c3bb3): the first step would pay them.
"""
from __future__ import annotations

import logging
import time

import torch

from minillm.ops import attention_ops
from minillm.runner.kv_sizing import prefill_batch

log = logging.getLogger(__name__)


def token_counts(max_tokens: int) -> list[int]:
    """Every count up to 16, then steps that grow with the count (cuBLAS picks kernels by size bands)."""
    counts = set(range(1, min(max_tokens, 16) + 1))
    for lo, hi, step in ((16, 1024, 16), (1024, 4096, 128), (4096, max_tokens, 1024)):
        counts.update(range(lo, min(hi, max_tokens) + 1, step))
    counts.add(max_tokens)
    return sorted(counts)


def logits_rows(max_rows: int) -> list[int]:
    return sorted(set(range(1, min(max_rows, 16) + 1)) | set(range(16, max_rows + 1, 8)) | {max_rows})


@torch.inference_mode()
def warm_up_shapes(runner) -> float:
    """One eager forward per token count (writing nothing to the cache) and one lm_head per row count.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    plan, arch = runner.plan, runner.arch
    if plan.prefill_sdpa_min_tokens or plan.prefill_prefix_min_tokens:
        attention_ops.warm_up_cudnn(arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, runner.dtype,
                                    runner.device)
    for n in token_counts(runner.max_num_tokens):
        ids, positions, meta, _ = prefill_batch(runner, n, write=False)
        runner.model(ids, positions, runner.kv_caches, meta)
    hidden = torch.zeros(runner.cfg.scheduler.max_num_seqs, runner.arch.hidden_size, dtype=runner.dtype,
                         device=runner.device)
    for rows in logits_rows(hidden.shape[0]):
        logits = runner.model.compute_logits(hidden[:rows], keep_dtype=True)
    runner.sampler.warm_up(logits)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    log.info("warmed the eager step path in %.2f s", seconds)
    return seconds
