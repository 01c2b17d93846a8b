"""Online latency: replay Poisson arrivals into the engine and timestamp every token when the caller sees it.

The driver is open-loop: a request's clock starts at the time it was due, even if the driver was inside a
step then, so queueing behind a long prefill shows up in TTFT instead of being hidden.
"""
from __future__ import annotations

import dataclasses
import time

from minillm.bench.offline import build_llm, free_device_memory, progress_bar, sampling_params, warm_up
from minillm.bench.stats import RequestTimeline, latency_summary
from minillm.bench.workloads import Workload
from minillm.engine.profile import StepProfile


def replay(llm, workload: Workload, rate: float, time_scale: float = 1.0,
           show_progress: bool = True) -> list[RequestTimeline]:
    """Add each request once its arrival time (scaled by time_scale) has passed; step while work remains."""
    if not time_scale > 0:
        raise ValueError(f"time_scale={time_scale!r} is not allowed: a number > 0")
    arrivals = [a * time_scale for a in workload.arrivals(rate)]
    params = sampling_params(workload)
    timelines: dict[str, RequestTimeline] = {}
    n, added, done, tokens = workload.num_requests, 0, 0, 0
    with progress_bar(show_progress) as bar:
        task = bar.add_task(f"{rate:g} req/s", total=n, tokens=0) if bar else None
        t0 = time.perf_counter()
        while added < n or llm.has_unfinished_requests():
            now = time.perf_counter()
            while added < n and t0 + arrivals[added] <= now:
                rid = llm.add_request(workload.prompts[added], params[added])
                timelines[rid] = RequestTimeline(arrival=t0 + arrivals[added])
                added += 1
            if not llm.has_unfinished_requests():
                time.sleep(max(0.0, t0 + arrivals[added] - time.perf_counter()))
                continue
            for out in llm.step():
                timelines[out.request_id].token_times.extend([out.time] * len(out.new_token_ids))
                tokens += len(out.new_token_ids)
                done += out.finished
            if bar:
                bar.update(task, completed=done, tokens=tokens)
    return list(timelines.values())


def budget_of(cfg) -> int:
    return cfg.scheduler.max_num_batched_tokens


def run_sweep_config(cfg, label: str, workload: Workload, rates: list[float], time_scale: float = 1.0,
                     show_progress: bool = True) -> list[dict]:
    """One engine, every rate in turn; one results line (without the stamp) per rate."""
    llm, load_s = build_llm(cfg)
    lines = []
    try:
        warmup_s = warm_up(llm, workload)
        for i, rate in enumerate(rates):
            # salted: the previous rate's prompts are still in the prefix cache
            llm.engine.profile = profile = StepProfile()
            timelines = replay(llm, workload.salted(i), rate, time_scale, show_progress)
            llm.engine.profile = None
            summary = latency_summary(timelines)
            if summary["output_tokens"] != workload.output_tokens:
                raise RuntimeError(f"{label} at {rate} req/s: {summary['output_tokens']} output tokens, "
                                   f"expected {workload.output_tokens}")
            lines.append({"kind": "latency", "engine": "minillm", "transport": "in-process", "label": label,
                          "rate": rate, "time_scale": time_scale, "budget": budget_of(cfg),
                          "chunked": cfg.scheduler.enable_chunked_prefill,
                          "attention_mode": cfg.runtime.attention_mode,
                          "kv_cache_dtype": cfg.cache.kv_cache_dtype, "config": dataclasses.asdict(cfg),
                          "workload": workload.summary(), "load_s": load_s, "warmup_s": warmup_s,
                          "kernels": llm.engine.runner.plan.record(), "step_profile": profile.summary(),
                          **summary})
    finally:
        del llm
        free_device_memory()
    return lines
