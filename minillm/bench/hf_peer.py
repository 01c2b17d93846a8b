"""The peer engine: Hugging Face transformers' continuous batching on the same workload and model shape.

Only the manager API that transformers 5.17 and 5.24 share is used: init_continuous_batching(generation_config),
start(), add_request(input_ids, request_id, max_new_tokens), get_result(timeout), stop(block). EOS is disabled
(eos_token_id=-1) so every request generates exactly its max_new_tokens, as minillm does with ignore_eos.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from minillm.bench.floor import DeviceRates, ModelShape, dtype_bytes, floor_record, workload_work
from minillm.bench.offline import progress_bar
from minillm.bench.workloads import Workload

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
WARMUP_REQUESTS = 4
RESULT_POLL_S = 1.0


def hf_config(model: str):
    """A transformers config for a checkpoint directory or a preset name (presets/<name>.json in HF format)."""
    from transformers import AutoConfig

    if Path(model).is_dir():
        return AutoConfig.from_pretrained(model)
    preset = PRESET_DIR / f"{model}.json"
    if not preset.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
        raise ValueError(f"model={model!r} is neither a checkpoint directory nor a preset; presets: {known}")
    data = json.loads(preset.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)


def build_hf_model(model: str, device: str, dtype: str):
    """Real weights for a checkpoint directory, random ones for a preset (EOS is ignored, so the work is the same)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if Path(model).is_dir():
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype, attn_implementation="sdpa")
    else:
        net = AutoModelForCausalLM.from_config(hf_config(model), dtype=torch_dtype, attn_implementation="sdpa")
    return net.to(device).eval()


def _generation_config(workload: Workload):
    from transformers import GenerationConfig

    # top_k=0 and top_p=1 match minillm's sampler for the workload: plain temperature sampling.
    return GenerationConfig(do_sample=True, temperature=workload.temperature, top_k=0, top_p=1.0,
                            max_new_tokens=max(workload.max_tokens), eos_token_id=-1, pad_token_id=0)


def _drain(manager, ids: set[str], on_result=None) -> None:
    """Wait until every request in ids has finished; raise on a failed request or a dead generation thread."""
    pending = set(ids)
    while pending:
        result = manager.get_result(timeout=RESULT_POLL_S)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' generation thread stopped with {len(pending)} requests left")
            continue
        if result.request_id not in pending or not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
        pending.discard(result.request_id)
        if on_result:
            on_result(result)


def _timed_pass(manager, workload: Workload, show_progress: bool) -> tuple[float, int]:
    tokens = done = 0
    with progress_bar(show_progress) as bar:
        task = bar.add_task(f"hf {workload.name}", total=workload.num_requests, tokens=0) if bar else None

        def count(result) -> None:
            nonlocal tokens, done
            tokens += len(result.generated_tokens)
            done += 1
            if bar:
                bar.update(task, completed=done, tokens=tokens)

        t0 = time.perf_counter()
        ids = {manager.add_request(input_ids=p, request_id=f"bench-{i}", max_new_tokens=m)
               for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens))}
        _drain(manager, ids, count)
        return time.perf_counter() - t0, tokens


def run_hf(model: str, workload: Workload, rates: DeviceRates, device: str, dtype: str = "bfloat16",
           show_progress: bool = True) -> dict:
    """Time transformers' continuous batching on the workload; returns a results line (without the stamp)."""
    import transformers

    t0 = time.perf_counter()
    net = build_hf_model(model, device, dtype)
    load_s = time.perf_counter() - t0
    manager = net.init_continuous_batching(generation_config=_generation_config(workload))
    t0 = time.perf_counter()
    # Newer releases pre-capture their CUDA graphs at the largest sizes here; without it the capture would land
    # inside the timed pass. Releases without the method capture lazily, which the warm-up requests cover.
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    try:
        warm = {manager.add_request(input_ids=p[:64], request_id=f"warmup-{i}", max_new_tokens=4)
                for i, p in enumerate(workload.salted(1).prompts[:WARMUP_REQUESTS])}
        _drain(manager, warm)
        warmup_s = time.perf_counter() - t0
        wall, tokens = _timed_pass(manager, workload, show_progress)
    finally:
        manager.stop(block=True)
    if tokens != workload.output_tokens:
        raise RuntimeError(f"hf peer produced {tokens} output tokens, the workload asks for {workload.output_tokens}")
    shape = ModelShape.from_arch(net.config.get_text_config())
    work = workload_work(shape, [len(p) for p in workload.prompts], workload.max_tokens, dtype_bytes(dtype),
                         workload.num_requests)
    config = {"model": model, "dtype": dtype, "device": device, "transformers": transformers.__version__,
              "attn_implementation": net.config._attn_implementation}
    return {"kind": "bench", "engine": "hf", "label": "hf-peer", "config": config, "workload": workload.summary(),
            "load_s": load_s, "warmup_s": warmup_s, "measure_s": rates.measure_s, "wall_s": wall,
            "walls_s": [wall], "output_tok_s": workload.output_tokens / wall,
            "total_tok_s": (workload.input_tokens + workload.output_tokens) / wall, "preemptions": None,
            "floor": floor_record(work, rates, wall)}
