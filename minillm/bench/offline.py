"""Offline throughput: build the engine, warm it up, then time one pass over the workload.

Only the pass itself is timed; engine construction (weights, KV pool, CUDA-graph capture) and the warm-up are
timed separately and recorded next to it (the kernel build is timed before any engine, in commands.py).
"""
from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time

from minillm.bench.floor import (DeviceRates, FloorWork, ModelShape, dtype_bytes, floor_record, kv_elem_bytes,
                                 workload_work)
from minillm.bench.workloads import Workload
from minillm.engine.profile import StepProfile
from minillm.progress import progress_bar
from minillm.sampling_params import SamplingParams

WARMUP_REQUESTS = 8
WARMUP_PROMPT_LEN = 64
WARMUP_MAX_TOKENS = 4


def sampling_params(workload: Workload) -> list[SamplingParams]:
    return [SamplingParams(temperature=workload.temperature, max_tokens=m, ignore_eos=True)
            for m in workload.max_tokens]


def build_llm(cfg):
    """Returns (llm, seconds): construction includes weight load, kernel build and graph capture."""
    from minillm import LLM
    from minillm.llm import freeze_heap

    t0 = time.perf_counter()
    llm = LLM.from_config(cfg)
    freeze_heap()
    return llm, time.perf_counter() - t0


def free_device_memory() -> None:
    """Return a dropped engine's GPU memory before the next configuration sizes its own KV pool.
    The caller must have deleted its last reference to the engine first."""
    import torch

    gc.unfreeze()   # build_llm froze the heap, the dropped engine's cycles included: let the collector reach them
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_up(llm, workload: Workload) -> float:
    """A short generate on prompts of their own (never the workload's, which would then hit the prefix cache)."""
    rng = random.Random(12345)
    top = workload.params.get("max_token_id", 10000)
    length = max(1, min(WARMUP_PROMPT_LEN, workload.max_model_len - WARMUP_MAX_TOKENS))
    prompts = [[rng.randint(0, top) for _ in range(length)] for _ in range(WARMUP_REQUESTS)]
    params = [SamplingParams(temperature=0.6, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True)] * WARMUP_REQUESTS
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def timed_pass(llm, workload: Workload, show_progress: bool) -> tuple[float, int, int]:
    """Add every request, step until all finish. Returns (wall seconds, output tokens, preemptions)."""
    params = sampling_params(workload)
    preempt0 = llm.num_preemptions
    tokens = done = 0
    with progress_bar(show_progress) as bar:
        task = bar.add_task(workload.name, total=workload.num_requests, tokens=0) if bar else None
        t0 = time.perf_counter()
        for prompt, p in zip(workload.prompts, params):
            llm.add_request(prompt, p)
        while llm.has_unfinished_requests():
            for out in llm.step():
                tokens += len(out.new_token_ids)
                done += out.finished
            if bar:
                bar.update(task, completed=done, tokens=tokens)
        wall = time.perf_counter() - t0
    return wall, tokens, llm.num_preemptions - preempt0


def floor_work(llm, workload: Workload, max_num_seqs: int, kv_cache_dtype: str = "auto") -> tuple[FloorWork, str]:
    """What `workload` must move and compute on this engine's model, dtype and KV-cache dtype
    (docs/architecture.md section 7), and the dtype's name."""
    work = workload_work(ModelShape.from_arch(llm.model_arch), [len(p) for p in workload.prompts],
                         workload.max_tokens, dtype_bytes(llm.dtype), max_num_seqs,
                         kv_elem_bytes(kv_cache_dtype, llm.dtype))
    return work, str(llm.dtype)


def run_config(cfg, workload: Workload, rates: DeviceRates, label: str, repeat: int = 1,
               show_progress: bool = True) -> dict:
    """Build, warm up and time one configuration; returns its results line (without the stamp)."""
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} is not allowed: an integer >= 1")
    llm, load_s = build_llm(cfg)
    try:
        warmup_s = warm_up(llm, workload)
        walls, preemptions = [], 0
        llm.engine.profile = profile = StepProfile()
        for r in range(repeat):
            wall, tokens, preempted = timed_pass(llm, workload.salted(r), show_progress)
            if tokens != workload.output_tokens:
                raise RuntimeError(f"{label}: produced {tokens} output tokens, the workload asks for "
                                   f"{workload.output_tokens} (is max_model_len too small?)")
            walls.append(wall)
            preemptions += preempted
        work, dtype = floor_work(llm, workload, cfg.scheduler.max_num_seqs, cfg.cache.kv_cache_dtype)
        model_kv_work, _ = floor_work(llm, workload, cfg.scheduler.max_num_seqs)
        kernels = llm.engine.runner.plan.record()
        kv_tokens = llm.engine.runner.num_blocks * cfg.cache.block_size   # what the pool holds at this config
    finally:
        del llm
        free_device_memory()
    wall = statistics.median(walls)
    return {"kind": "bench", "engine": "minillm", "label": label, "config": dataclasses.asdict(cfg), "dtype": dtype,
            "kv_cache_dtype": cfg.cache.kv_cache_dtype, "kv_cache_tokens": kv_tokens, "workload": workload.summary(), "load_s": load_s, "warmup_s": warmup_s,
            "measure_s": rates.measure_s, "wall_s": wall, "walls_s": walls,
            "output_tok_s": workload.output_tokens / wall,
            "total_tok_s": (workload.input_tokens + workload.output_tokens) / wall,
            "preemptions": preemptions, "floor": floor_record(work, rates, wall, model_kv_work), "kernels": kernels,
            "step_profile": profile.summary()}
