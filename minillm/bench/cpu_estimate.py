"""How long a bench run will take on the CPU, said before it starts.

On a CPU the torch attention path dominates: every decode step gathers each running sequence's K and V, padded
to the longest context in the batch, and passes over that copy a few more times on its way through the matmuls.
So the estimate replays the workload's decode steps under continuous batching (at most max_num_seqs running, and
no more tokens than the CPU's default KV pool holds), and charges each step the weights plus ATTENTION_PASSES
over the padded K/V at this CPU's measured copy bandwidth, plus the prefill FLOPs at its measured matmul rate.
ATTENTION_PASSES is effective, not counted: about five passes, with the gather of scattered blocks running well
below copy bandwidth. It was fitted to two runs on a 2-core machine (1,043 s for the first 4 reference requests
on the 0.6B preset, estimated 1,170 s; about 1,600 s for all 256 on the demo model, estimated 1,000 s). The
estimate is meant to tell minutes from hours, not to be exact.
"""
from __future__ import annotations

import time

from minillm.bench.floor import ModelShape, workload_work

ATTENTION_PASSES = 12
CPU_KV_MIN_BYTES, CPU_KV_MAX_BYTES = 256 << 20, 2 << 30    # the CPU pool's caps (minillm/runner/kv_sizing.py)


def measure_cpu_rates(nbytes: int = 128 << 20, n: int = 1024) -> tuple[float, float]:
    """(copy bytes/s counting read + write, float32 matmul FLOP/s): the best of three tries each."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    copy_s, gemm_s = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.mm(a, b)
        gemm_s.append(time.perf_counter() - t0)
    return 2 * nbytes / min(copy_s), 2 * n**3 / min(gemm_s)


def decode_bytes(prompt_lens: list[int], max_tokens: list[int], max_num_seqs: int, pool_tokens: int,
                 weight_bytes: int, kv_bytes_per_token: int) -> int:
    """Bytes the decode steps move: per step the weights, plus ATTENTION_PASSES over the running sequences'
    K/V padded to the longest of them. Requests join in order while a batch slot and pool room are free."""
    waiting = list(zip(prompt_lens, max_tokens))
    waiting.reverse()                       # pop() takes the first request
    running: list[list[int]] = []           # [context so far, tokens still to generate]
    total = 0
    while waiting or running:
        held = sum(ctx for ctx, _ in running)
        while waiting and len(running) < max_num_seqs and (not running or held + sum(waiting[-1]) <= pool_tokens):
            prompt, out = waiting.pop()
            running.append([prompt, out])
            held += prompt + out
        longest = max(ctx for ctx, _ in running)
        total += weight_bytes + ATTENTION_PASSES * len(running) * longest * kv_bytes_per_token
        for seq in running:
            seq[0] += 1
            seq[1] -= 1
        running = [seq for seq in running if seq[1] > 0]
    return total


def estimate_seconds(arch, workload, cfg, rates: tuple[float, float] | None = None) -> float:
    """Rough wall seconds of `workload` on the CPU engine `cfg` with model `arch` (float32 unless the config
    names another dtype)."""
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.model.dtype, 4)
    shape = ModelShape.from_arch(arch)
    prompt_lens = [len(p) for p in workload.prompts]
    work = workload_work(shape, prompt_lens, workload.max_tokens, dtype_bytes, cfg.scheduler.max_num_seqs)
    weights = arch.num_params * dtype_bytes
    kv_token = shape.kv_bytes_per_token(dtype_bytes)
    pool = cfg.cache.num_kv_blocks * cfg.cache.block_size if cfg.cache.num_kv_blocks else \
        min(CPU_KV_MAX_BYTES, max(CPU_KV_MIN_BYTES, weights)) // kv_token
    moved = decode_bytes(prompt_lens, workload.max_tokens, cfg.scheduler.max_num_seqs, pool,
                         shape.step_weight_bytes(dtype_bytes), kv_token)
    copy_rate, gemm_rate = rates or measure_cpu_rates()
    return moved / copy_rate + work.prefill_flops / gemm_rate


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
