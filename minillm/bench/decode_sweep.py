"""The cost of one decode step against the batch size, next to its bandwidth floor.

Method (per batch size B): B requests with PROMPT_LEN-token prompts, admitted together, each forced to produce
OUT_TOKENS tokens (ignore_eos); the same with one output token. The difference of the two wall times is
OUT_TOKENS - 1 decode steps of B rows, so

    ms per step = (time of OUT_TOKENS tokens - time of 1 token) / (OUT_TOKENS - 1)

takes the prefill, admission and the first sampling out. The floor of those steps is what they must read at the
copy bandwidth measured in the same run: all the weights once per step, and every row's KV (the step producing
output k of a row reads PROMPT_LEN + k tokens of it). Prefix caching is off, so no run reuses another's prompt.
"""
from __future__ import annotations

import dataclasses
import random
import time

from minillm.bench.floor import DeviceRates, ModelShape, dtype_bytes, kv_elem_bytes
from minillm.sampling_params import SamplingParams

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPT_LEN, OUT_TOKENS = 128, 512


def sweep_config(cfg, max_batch: int, prompt_len: int = PROMPT_LEN, out_tokens: int = OUT_TOKENS):
    """The engine config of the sweep: room for max_batch rows of prompt + output, no prefix reuse."""
    from minillm.config import EngineConfig

    return EngineConfig.from_kwargs(base=cfg, max_num_seqs=max(max_batch, cfg.scheduler.max_num_seqs),
                                    max_model_len=prompt_len + out_tokens + 16, enable_prefix_caching=False)


def step_floor_ms(shape: ModelShape, dtype: str, batch: int, prompt_len: int, out_tokens: int,
                  copy_bytes_per_s: float | None, kv_cache_dtype: str = "auto") -> float | None:
    """Bytes a mean decode step of the method must read, over the copy bandwidth."""
    if not copy_bytes_per_s:
        return None
    b, kv_b = dtype_bytes(dtype), kv_elem_bytes(kv_cache_dtype, dtype)
    steps = out_tokens - 1
    # steps 1..steps produce outputs 1..steps, reading prompt_len + k token-KVs of each row
    kv_tokens = batch * sum(prompt_len + k for k in range(1, steps + 1)) / steps
    return (shape.step_weight_bytes(b, batch) + kv_tokens * shape.kv_bytes_per_token(kv_b)) / copy_bytes_per_s * 1e3


def _timed_generate(llm, batch: int, max_tokens: int, seed: int, prompt_len: int) -> float:
    rng = random.Random(seed)
    vocab = llm.model_arch.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    _sync(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(llm)
    wall = time.perf_counter() - t0
    if any(len(o.token_ids) != max_tokens for o in outs):
        raise RuntimeError(f"B={batch}: a request stopped before {max_tokens} tokens")
    return wall


def _sync(llm) -> None:
    if llm.device.type == "cuda":
        import torch
        torch.cuda.synchronize()


def measure_batch(llm, batch: int, rates: DeviceRates, prompt_len: int = PROMPT_LEN, out_tokens: int = OUT_TOKENS,
                  repeat: int = 2) -> dict:
    """One results line: the median of `repeat` differences, and the floor."""
    diffs = []
    for r in range(repeat):
        one = _timed_generate(llm, batch, 1, seed=1000 * batch + 2 * r, prompt_len=prompt_len)
        full = _timed_generate(llm, batch, out_tokens, seed=1000 * batch + 2 * r + 1, prompt_len=prompt_len)
        diffs.append((full - one) / (out_tokens - 1) * 1e3)
    ms = sorted(diffs)[len(diffs) // 2]
    shape = ModelShape.from_arch(llm.model_arch)
    kv_dtype = llm.config.cache.kv_cache_dtype
    floor = step_floor_ms(shape, str(llm.dtype), batch, prompt_len, out_tokens, rates.copy_bytes_per_s, kv_dtype)
    model_kv_floor = step_floor_ms(shape, str(llm.dtype), batch, prompt_len, out_tokens, rates.copy_bytes_per_s)
    return {"kind": "decode_step", "model": llm.config.model.model or DEMO, "kv_cache_dtype": kv_dtype,
            "floor_ms_model_dtype_kv": model_kv_floor, "batch_size": batch, "ms_per_step": ms, "ms_per_step_runs": diffs,
            "floor_ms": floor, "fraction_of_floor": floor / ms if floor else None, "prompt_len": prompt_len,
            "out_tokens": out_tokens, "copy_bytes_per_s": rates.copy_bytes_per_s, "dtype": str(llm.dtype),
            "kernels": _kernels(llm), "config": dataclasses.asdict(llm.config)}


def _kernels(llm) -> dict | None:
    # The execution plan's record; an older tree (an A/B run) has a KernelChoice, or nothing before that.
    runner = llm.engine.runner
    plan = getattr(runner, "plan", None) or getattr(runner, "kernels", None)
    return plan.record() if plan is not None else None


def run_decode_sweep(cfg, rates: DeviceRates, batch_sizes=BATCH_SIZES, prompt_len: int = PROMPT_LEN,
                     out_tokens: int = OUT_TOKENS, on_line=None) -> list[dict]:
    """Build one engine for every batch size, warm it up, measure each; on_line(line) after each one."""
    from minillm.bench.offline import build_llm, free_device_memory

    llm, _ = build_llm(sweep_config(cfg, max(batch_sizes), prompt_len, out_tokens))
    lines = []
    try:
        _timed_generate(llm, max(batch_sizes), 4, seed=7, prompt_len=prompt_len)   # warm-up: lazy inits
        for b in batch_sizes:
            line = measure_batch(llm, b, rates, prompt_len, out_tokens)
            lines.append(line)
            if on_line is not None:
                on_line(line)
    finally:
        del llm
        free_device_memory()
    return lines


DEMO = "demo"   # model.model unset: the embedded demo model


def line_model(line: dict) -> str:
    """The model a decode_step line measured: its `model` field, or (older lines) the config's model.model."""
    return line.get("model") or ((line.get("config") or {}).get("model") or {}).get("model") or DEMO


def plot_decode_steps(lines: list[dict], path, current: str | None = None, previous: str | None = None,
                      model: str | None = None) -> None:
    """ms per step against the batch size: the current commit's curve, the previous commit's, and the floor.
    current/previous: commits to draw; by default the two whose newest lines are newest. model: only that model's
    lines (one file holds several models' sweeps; their curves are not comparable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    by_commit: dict[str, list[dict]] = {}
    steps = (ln for ln in lines if ln.get("kind") == "decode_step" and (model is None or line_model(ln) == model))
    for line in sorted(steps, key=lambda ln: ln.get("date", "")):
        by_commit.setdefault(line.get("commit", "?"), []).append(line)
    if not by_commit:
        raise ValueError("no decode_step lines to plot")
    order = list(by_commit)
    current = current or order[-1]
    previous = previous or next((c for c in reversed(order) if c != current), None)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (commit, role) in enumerate(((current, "this commit"), (previous, "previous commit"))):
        if commit is None:
            continue
        pts = {ln["batch_size"]: ln for ln in by_commit[commit]}      # newest line per batch size
        xs = sorted(pts)
        ax.plot(xs, [pts[x]["ms_per_step"] for x in xs], "o-", color=f"C{i}", label=f"{commit} ({role})")
        if i == 0 and all(pts[x]["floor_ms"] for x in xs):
            ax.plot(xs, [pts[x]["floor_ms"] for x in xs], "k--", label="bandwidth floor")
    newest = by_commit[current][-1]
    gpu = (newest.get("fingerprint") or {}).get("gpu") or "no GPU"
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({ln["batch_size"] for ln in by_commit[current]}))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("batch size (decode rows per step)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"decode step vs batch size, {line_model(newest)}, {gpu}, "
                 f"{newest.get('date', '?')[:10]}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_and_record(cfg, output, batch_sizes=BATCH_SIZES, plot: bool = True) -> list[dict]:
    """Measure the device, run the sweep, append each line to `output` (stamped) as it comes, redraw the figure
    next to it (decode_steps.png) from every line the file holds. Prints one row per batch size."""
    from pathlib import Path

    from minillm.bench.floor import measure_device
    from minillm.bench.report import append_jsonl, read_jsonl

    rates = measure_device("cuda" if cfg.runtime.device != "cpu" else "cpu")
    print(f"{'batch':>6} {'ms/step':>9} {'floor ms':>9} {'% floor':>8}", flush=True)

    def show(line: dict) -> None:
        append_jsonl(output, line)
        frac = line["fraction_of_floor"]
        print(f"{line['batch_size']:>6} {line['ms_per_step']:>9.3f} {line['floor_ms'] or float('nan'):>9.3f} "
              f"{100 * frac if frac else float('nan'):>7.1f}%", flush=True)

    lines = run_decode_sweep(cfg, rates, batch_sizes, on_line=show)
    if plot:
        plot_decode_steps(read_jsonl(output), Path(output).with_name("decode_steps.png"),
                          model=cfg.model.model or DEMO)
    return lines


if __name__ == "__main__":   # python -m minillm.bench.decode_sweep [--output FILE]: the 0.6B preset, dummy weights
    import argparse

    from minillm.config import EngineConfig

    ap = argparse.ArgumentParser(description="decode step vs batch size on the Qwen3-0.6B shape")
    ap.add_argument("--output", default="results/decode_steps.jsonl")
    ap.add_argument("--batches", default=",".join(map(str, BATCH_SIZES)))
    args = ap.parse_args()
    base = EngineConfig.from_kwargs("qwen3-0.6b", load_format="dummy")
    sweep_and_record(base, args.output, tuple(int(b) for b in args.batches.split(",")))
