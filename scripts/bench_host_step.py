"""Host time of one decode step of LLM.step() (async scheduling, the default), the model math taken out.

The engine runs the demo model's tokenizer and a one-layer, 128-wide model of the demo model's vocabulary, and
its eager forward pass and LM head are replaced by views of preallocated tensors: what is left is the host work
of a step (schedule, input build, runner bookkeeping, the sampler's torch calls on [B, V] logits, resolve,
update, output processing, detokenization). On the CPU (the default) torch ops run synchronously, so the
sampler's argmax over the vocabulary is in the figure (a few us at B=1); a CPU run also does not see what a
torch op costs the host on a GPU (a launch, a copy, an allocation), so it prints how many a step dispatches.
With --device cuda the decode graphs replay the captured one-layer model (a few us of GPU work) and the step's
wall time is the host's share of a step on that machine.

    python scripts/bench_host_step.py [--batch 1 8 64 256] [--steps 400] [--temperature 0] [--seed]
                                      [--device cpu|cuda] [--profile B] [--top 25] [--phases]

Prints, per batch size, the median, p10 and p90 us per step over --steps decode steps, and the torch ops a step
dispatches (top-level ones, counted by torch.profiler over 20 more steps); --profile B also prints cProfile's
top functions (by own time) for batch B; --phases also prints the mean us per step of each phase of the engine
core's StepProfile and of the output processing (more steps, timed with the profile attached).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minillm import LLM, SamplingParams
from minillm.model.loader import DEMO_MODEL_DIR

# One layer of one 128-wide head: shapes every GPU kernel covers, and almost no math.
TINY = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, head_dim=128)


def tiny_model_dir(root: Path) -> Path:
    """The demo model's config and tokenizer, with the layers shrunk to almost nothing (dummy weights)."""
    cfg = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    cfg.update(TINY, max_position_embeddings=1 << 16)
    (root / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, root / name)
    return root


class StubModel(torch.nn.Module):
    """Stands in for the model: forward and compute_logits return views of fixed tensors (no math)."""

    def __init__(self, max_tokens: int, hidden: int, vocab: int, fresh: bool, device, dtype) -> None:
        super().__init__()
        self.fresh = fresh
        gen = torch.Generator().manual_seed(0)
        self.hidden = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
        self.logits = torch.randn(max_tokens, vocab, generator=gen).to(device, dtype)

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden, *, keep_dtype: bool = False):
        # A temperature other than 1 divides the logits in place: then each step needs a fresh copy.
        logits = self.logits[: hidden.shape[0]]
        return logits.clone() if self.fresh else logits


def make_llm(path: Path, batch: int, steps: int, temperature: float, device: str = "cpu") -> LLM:
    llm = LLM(str(path), load_format="dummy", device=device, dtype="float32" if device == "cpu" else "bfloat16",
              max_num_seqs=max(batch, 1), max_model_len=steps + 256)
    runner = llm.engine.runner
    runner.model = StubModel(runner.max_num_tokens, TINY["hidden_size"], runner.vocab_size,
                             fresh=temperature not in (0.0, 1.0), device=runner.device, dtype=runner.dtype)
    # The CPU checks every step's logits for NaN (a pass over [B, V]); the GPU checks one step in 64. Both left
    # out.
    runner.sampler.nonfinite.seen = True
    return llm


def fill(llm: LLM, batch: int, params: SamplingParams) -> None:
    """`batch` requests of 32-token prompts, prefilled, then a few decode steps (not timed)."""
    for i in range(batch):
        llm.add_request([(7 * i + j) % 4000 + 10 for j in range(32)], params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in llm.step() if o.new_token_ids)
    for _ in range(5):
        llm.step()


def time_steps(llm: LLM, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
    return times


def ops_per_step(llm: LLM, steps: int = 20) -> float:
    """torch ops dispatched per step (top-level ones: an op called inside another is not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(llm, steps)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None) / steps


def phases(llm: LLM, steps: int) -> dict[str, float]:
    """us per step of each phase of the engine core's StepProfile (minillm/engine/profile.py) over `steps` more
    steps, and 'outputs': the rest of LLM.step() (output processing, detokenization)."""
    from minillm.engine.profile import StepProfile

    llm.engine.core.profile = prof = StepProfile()
    wall = sum(time_steps(llm, steps))
    llm.engine.core.profile = None
    out = {p: 1e6 * t / steps for p, t in prof.summary()["total_s"].items()}
    out["outputs"] = 1e6 * wall / steps - sum(out.values())
    return out


def run(path: Path, batch: int, args) -> tuple[list[float], float, cProfile.Profile | None, dict | None]:
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=2 * args.steps + 64,
                            seed=1234 if args.seed else None)
    llm = make_llm(path, batch, 2 * args.steps, args.temperature, args.device)
    fill(llm, batch, params)
    times = time_steps(llm, args.steps)
    ops = ops_per_step(llm)
    split = phases(llm, args.steps) if args.phases else None
    prof = None
    if args.profile == batch:
        prof = cProfile.Profile()
        prof.enable()
        time_steps(llm, args.steps)
        prof.disable()
    llm.close()
    return times, ops, prof, split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", action="store_true", help="every request carries a per-request seed")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--profile", type=int, default=None, help="also cProfile the steps of this batch size")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--phases", action="store_true",
                    help="also print where a step goes (mean us: schedule, build, forward, sample_sync, update, "
                         "outputs) over --steps more steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model_dir(Path(tmp))
        for batch in args.batch:
            times, ops, prof, split = run(path, batch, args)
            us = sorted(t * 1e6 for t in times)
            q = statistics.quantiles(us, n=10)
            print(f"B={batch:4d}: median {statistics.median(us):7.1f} us/step  p10 {q[0]:7.1f}  p90 {q[-1]:7.1f}  "
                  f"{ops:5.1f} torch ops/step ({args.device}, {args.steps} steps, T={args.temperature}, "
                  f"seeded={args.seed})",
                  flush=True)
            if split is not None:
                print("        phases (mean us/step): " + "  ".join(f"{k} {v:.0f}" for k, v in split.items()),
                      flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
