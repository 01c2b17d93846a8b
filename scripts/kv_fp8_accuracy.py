"""Accuracy of the fp8 KV cache against bf16 (and fp32) KV; one JSON line per run appended to results/kv_fp8.jsonl.

cpu mode (the embedded demo model):
  - perplexity on held-out text: the docstrings of standard-library modules that scripts/train_demo_model.py skips
    (SKIP_MODULES: turtle, tkinter, idlelib, ...), read from their source with ast (nothing is imported), cut into
    windows of --window tokens; model bf16 with a bf16 cache (ppl_bf16) and an fp8 cache (ppl_fp8), and the fp32
    model with an fp32 cache (ppl_fp32);
  - greedy agreement: --prompts prompts (the first --prompt-tokens tokens of held-out docstrings), --tokens greedy
    tokens each, bf16 model with bf16 vs fp8 cache: greedy_agreement = mean over prompts of the length of the
    common prefix / tokens; greedy_identical = fraction of prompts whose continuations are equal; the same two
    for the bf16 engine against the fp32 one (*_bf16_vs_fp32), the yardstick.
gpu mode (the Qwen3-0.6B shape with dummy weights, bf16): one sequence of random token ids run through the model in
  prefill chunks; kl_mean[ctx] = mean KL(bf16 || fp8) of the next-token distributions of the last --kl-rows
  positions before ctx, for ctx in 512, 4096, 16384.

    python scripts/kv_fp8_accuracy.py cpu [--kv fp8|fp8_e5m2] [--kv-scales calibrated|unit]
    python scripts/kv_fp8_accuracy.py gpu
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minillm.attention.metadata import AttentionMetadata  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402

HELD_OUT = ("turtle.py", "tkinter", "idlelib", "turtledemo", "venv", "ensurepip")   # skipped by the demo's training
RESULTS = ROOT / "results" / "kv_fp8.jsonl"
# --kv-scales: neither model has checkpoint scales, so the cache's scales are 1.0 or calibrated at start-up
SCALES_NOTE = {"unit": "1.0 (cache.calculate_kv_scales off; the checkpoint has none)",
               "calibrated": "calibrated at start-up (cache.calculate_kv_scales, minillm/runner/kv_calibration.py)"}


def held_out_docstrings() -> list[str]:
    """Docstrings (module, class, function) of the held-out stdlib sources, in file order, deduplicated."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in HELD_OUT:
        p = lib / name
        files += [p] if p.is_file() else sorted(p.rglob("*.py")) if p.is_dir() else []
    seen, docs = set(), []
    for f in files:
        if "idle_test" in f.parts:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40 and doc not in seen:
                    seen.add(doc)
                    docs.append(doc)
    return docs


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@torch.inference_mode()
def chunked_logits(llm: LLM, ids: list[int], rows: list[int], chunk: int) -> torch.Tensor:
    """Run one sequence through the model in prefill chunks of `chunk` tokens (each attending to the cached ones
    before it, through the cache under test); fp32 logits [len(rows), V] at positions `rows`."""
    runner = llm.engine.runner
    bs, dev = runner.cfg.cache.block_size, runner.device
    nb = -(-len(ids) // bs)
    if nb > runner.num_blocks:
        raise SystemExit(f"{len(ids)} tokens need {nb} KV blocks; the pool has {runner.num_blocks}")
    table = torch.arange(nb, dtype=torch.int32, device=dev)[None]
    want = sorted(set(rows))
    out = {}
    for lo in range(0, len(ids), chunk):
        hi = min(len(ids), lo + chunk)
        pos = torch.arange(lo, hi, device=dev)
        meta = AttentionMetadata(num_seqs=1, num_decodes=0, num_tokens=hi - lo, max_query_len=hi - lo,
                                 max_seq_len=hi, slot_mapping=pos.long(),   # blocks 0.. in order: slot = position
                                 query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32, device=dev),
                                 seq_lens=torch.tensor([hi], dtype=torch.int32, device=dev), block_tables=table,
                                 block_size=bs, query_start_loc_cpu=[0, hi - lo], seq_lens_cpu=[hi])
        hidden = runner.model(torch.tensor(ids[lo:hi], device=dev), pos, runner.kv_caches, meta)
        mine = [r for r in want if lo <= r < hi]
        if mine:
            logits = runner.model.compute_logits(hidden[torch.tensor(mine, device=dev) - lo]).float().cpu()
            out.update(zip(mine, logits))
    return torch.stack([out[r] for r in rows])


def perplexity(llm: LLM, windows: list[list[int]], chunk: int) -> float:
    nll, count = 0.0, 0
    for ids in windows:
        logits = chunked_logits(llm, ids, list(range(len(ids) - 1)), chunk)
        target = torch.tensor(ids[1:])
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(target)
    return float(torch.tensor(nll / count).exp())


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(len(x), 1))
    return sum(prefix) / len(prefix), sum(p == 1.0 for p in prefix) / len(prefix)


def cpu_mode(args) -> dict:
    torch.set_num_threads(args.threads)
    docs = held_out_docstrings()
    engines = {}

    def engine(dtype: str, kv: str) -> LLM:
        if (dtype, kv) not in engines:
            engines.clear()   # one engine at a time
            engines[(dtype, kv)] = LLM(dtype=dtype, kv_cache_dtype=kv, device="cpu", max_num_seqs=args.prompts,
                                       calculate_kv_scales=args.kv_scales == "calibrated")
        return engines[(dtype, kv)]

    tok = engine("bfloat16", "auto").tokenizer
    eos = sorted(tok.eos_token_ids)[:1]   # documents end with <|endoftext|>, as in training
    stream = [i for d in docs for i in tok.encode(d) + eos]
    windows = [stream[i:i + args.window] for i in range(0, min(len(stream), args.eval_tokens), args.window)]
    windows = [w for w in windows if len(w) > 1]
    prompts = [tok.encode(d)[:args.prompt_tokens] for d in docs[: args.prompts]]
    t0 = time.time()
    rec = {"mode": "cpu", "model": "demo", "text": f"docstrings of stdlib {', '.join(HELD_OUT)} (excluded from the "
           f"demo model's training), {sum(len(w) for w in windows)} tokens in windows of {args.window}",
           "kv_cache_dtype": args.kv}
    rec["ppl_fp32"] = perplexity(engine("float32", "auto"), windows, args.chunk)
    base = greedy(engines[("float32", "auto")], prompts, args.tokens)
    rec["ppl_bf16"] = perplexity(engine("bfloat16", "auto"), windows, args.chunk)
    ref = greedy(engines[("bfloat16", "auto")], prompts, args.tokens)
    rec["ppl_fp8"] = perplexity(engine("bfloat16", args.kv), windows, args.chunk)
    test = greedy(engines[("bfloat16", args.kv)], prompts, args.tokens)
    rec["ppl_fp8_vs_bf16"] = rec["ppl_fp8"] / rec["ppl_bf16"] - 1
    rec["greedy_agreement"], rec["greedy_identical"] = agreement(ref, test)
    # the yardstick: how far bf16 itself (model and cache) is from fp32 on the same prompts
    rec["greedy_agreement_bf16_vs_fp32"], rec["greedy_identical_bf16_vs_fp32"] = agreement(base, ref)
    rec.update(prompts=len(prompts), tokens_per_prompt=args.tokens, prompt_tokens=args.prompt_tokens,
               kv_scales=SCALES_NOTE[args.kv_scales], seconds=round(time.time() - t0, 1))
    return rec


def gpu_mode(args) -> dict:
    contexts = [c for c in (512, 4096, 16384) if c <= args.max_context]
    total = max(contexts)
    ids = torch.randint(0, 151936, (total,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = [r for c in contexts for r in range(c - args.kl_rows, c)]
    logp = {}
    for kv in ("auto", args.kv):
        llm = LLM("qwen3-0.6b", dtype="bfloat16", kv_cache_dtype=kv, max_model_len=total + 16, max_num_seqs=4,
                  max_num_batched_tokens=args.chunk, enforce_eager=True,
                  calculate_kv_scales=args.kv_scales == "calibrated")
        logp[kv] = torch.log_softmax(chunked_logits(llm, ids, rows, args.chunk), dim=-1)
        del llm
        torch.cuda.empty_cache()
    kl = (logp["auto"].exp() * (logp["auto"] - logp[args.kv])).sum(-1)
    by_ctx = {str(c): float(kl[i * args.kl_rows:(i + 1) * args.kl_rows].mean()) for i, c in enumerate(contexts)}
    top1 = (logp["auto"].argmax(-1) == logp[args.kv].argmax(-1)).float().mean().item()
    return {"mode": "gpu", "model": "qwen3-0.6b (dummy weights, seed 0)", "text": "random token ids, seed 0",
            "kv_cache_dtype": args.kv, "kl_mean": by_ctx, "kl_rows": args.kl_rows, "top1_agreement": top1,
            "kv_scales": SCALES_NOTE[args.kv_scales], "device": torch.cuda.get_device_name()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("cpu", "gpu"))
    p.add_argument("--kv", default="fp8", choices=("fp8", "fp8_e5m2"))
    p.add_argument("--kv-scales", default="calibrated", choices=sorted(SCALES_NOTE))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--kl-rows", type=int, default=32)
    p.add_argument("--max-context", type=int, default=16384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    rec = cpu_mode(args) if args.mode == "cpu" else gpu_mode(args)
    rec.update(commit=commit(), torch=torch.__version__)
    line = json.dumps(rec)
    print(line)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
