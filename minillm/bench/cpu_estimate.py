"""How long a bench run will take on the CPU, said before it starts.

The floor of docs/architecture.md (section 7) with this CPU's copy bandwidth and matmul rate, measured in about
a second, times CPU_OVERHEAD: the torch path on a CPU runs well above its floor (per-sequence attention,
eager launches, the host work of each step), and the factor was measured on the 0.6B preset on a 2-core
machine. The estimate is meant to tell minutes from hours, not to be exact.
"""
from __future__ import annotations

import time

from minillm.bench.floor import ModelShape, workload_work

CPU_OVERHEAD = 3.0


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


def estimate_seconds(arch, workload, cfg, rates: tuple[float, float] | None = None) -> float:
    """Rough wall seconds of `workload` on the CPU engine `cfg` with model `arch` (float32 unless the config
    names another dtype)."""
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.model.dtype, 4)
    work = workload_work(ModelShape.from_arch(arch), [len(p) for p in workload.prompts], workload.max_tokens,
                         dtype_bytes, cfg.scheduler.max_num_seqs)
    copy_rate, gemm_rate = rates or measure_cpu_rates()
    return CPU_OVERHEAD * (work.total_bytes / copy_rate + work.prefill_flops / gemm_rate)


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
