#!/usr/bin/env python3
"""Cost of structured outputs per decode step: B requests decoding, with no row constrained, every row
constrained by a JSON schema, and half of them (mixed), on the same engine. Meant for a GPU (the H200 target:
every row constrained at B=64 costs <= 5% more per step than unconstrained).

Model: --model DIR (a checkpoint directory with its tokenizer.json), or by default the Qwen3-0.6B shape with
random weights and a synthetic byte-level vocabulary of the same size (151,936 tokens: random strings of 1-8
bytes; the real Qwen vocabulary is not shipped). The masks' device work depends on the vocabulary size only; the
host fill depends on the vocabulary's strings too, so the synthetic one is an approximation of Qwen's.

Where the masks are filled: on a thread of the engine's process, beside its host work (the default); with
--mask-worker in a process of their own; with --serial-masks on that thread but waited for at once, so the fill
sits on the host's critical path (what every step paid before the fill overlapped: the A/B of the overlap).
On CUDA the stream itself waits for each bitmask (structured.mask_wait auto: the sampler is queued behind the
forward); --mask-wait host has the host launch the sampler once the fill is in instead (the A/B of that wait).

Requests carry no seed unless --seeded: a seeded row samples with its own generator, a host cost of its own
that would hide the masks' cost.

Per step: wall time of LLMEngine.step() (async scheduling on: host work of step N+1 overlaps step N), counted
only on steps where all B requests are decoding; the median is reported. Constrained rows get min_tokens =
max_tokens, so they stop only where their grammar is complete (those steps, with fewer rows, are not counted).
With --profile: a torch.profiler trace of --profile-steps steps per mode at the largest B, summarised as GPU
busy time / wall time (mask building on the host must not leave the GPU idle: the all-constrained figure should
match the unconstrained one) and the top kernels, written to results/profiles/structured_B{B}_{mode}.txt.
On CUDA every line also carries the gpu_* fields: from CUDA events around each full step's forward and sampler
(no profiler), the GPU's busy fraction and the median forward, mask stall (forward done to sampler start),
sampler and between-step gap (gpu_timeline).

Usage: python scripts/structured_bench.py [--batches 16,64] [--steps 64] [--model DIR] [--profile]
       [--mask-worker | --serial-masks] [--mask-wait auto|host] [--seeded] [--rounds R]
       [--out results/structured.jsonl]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from minillm.bench.report import append_jsonl  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.structured.spec import from_response_format  # noqa: E402

ITEM = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "name", "tags"]}
# minItems keeps every constrained row inside its object for all the timed steps: with a shorter schema the
# rows complete (and stop) after a dozen tokens, and too few full steps are left to time.
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 40}},
          "required": ["items"]}
PRESET = Path(__file__).resolve().parents[1] / "minillm" / "presets" / "qwen3-0.6b.json"


def synthetic_model_dir(root: Path, tiny: bool = False) -> Path:
    """config.json of the Qwen3-0.6B preset (tiny: its layers shrunk to bench_host_step's one-layer model) and a
    WordLevel byte-level tokenizer of its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    cfg = json.loads(PRESET.read_text())
    vocab_size, eos = cfg["vocab_size"], cfg["eos_token_id"]
    alphabet = sorted(ByteLevel.alphabet())
    rng = random.Random(0)
    vocab: dict[str, int] = {}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    while len(vocab) < eos:
        vocab.setdefault("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))), len(vocab))
    tok = Tokenizer(models.WordLevel({**vocab, "<|im_end|>": eos}, unk_token=alphabet[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    data = json.loads((root / "tokenizer.json").read_text())
    data["added_tokens"] = [{"id": eos, "content": "<|im_end|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}]
    (root / "tokenizer.json").write_text(json.dumps(data))
    if tiny:
        from bench_host_step import TINY
        cfg.update(TINY)
    (root / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab_size}))
    return root


def stub_model(llm: LLM) -> None:
    """bench_host_step's stand-in model: fixed hidden states and logits (a fresh copy of the logits each step,
    since the grammar mask writes into them)."""
    from bench_host_step import StubModel
    runner = llm.engine.runner
    runner.model = StubModel(runner.max_num_tokens, runner.arch.hidden_size, runner.vocab_size, fresh=True,
                             device=runner.device, dtype=runner.dtype)
    runner.sampler.nonfinite.seen = True


class HostClock:
    """Where the engine thread's time goes on timed steps: blocked (CUDA event syncs, waits for a mask worker's
    answer or flag) or inside a named part of the step (its own work, the waits within it excluded; parts nest, so
    masks includes its own sub-parts). busy = wall - blocked is the host's share of a step: when it nears the
    GPU's step time, every extra microsecond of it shows as gap."""

    # (module, class, method, part name): the step's host work, from schedule to output processing, and
    # GrammarRows.masks with its pieces.
    PARTS = (("minillm.engine.scheduler", "Scheduler", "schedule", "schedule"),
             ("minillm.engine.scheduler", "Scheduler", "update", "scheduler_update"),
             ("minillm.engine.scheduler", "Scheduler", "apply_sampled_tokens", "apply_tokens"),
             ("minillm.runner.model_runner", "ModelRunner", "update_states", "runner_states"),
             ("minillm.runner.input_batch", "InputBuilder", "build", "inputs"),
             ("minillm.runner.cuda_graphs", "DecodeGraphs", "replay", "replay"),
             ("minillm.model.qwen3", "QwenForCausalLM", "compute_logits", "lm_head"),
             ("minillm.sampling.batch", "SamplingBatchCache", "get", "sampling_batch"),
             ("minillm.sampling.sampler", "Sampler", "__call__", "sampler"),
             ("minillm.runner.model_runner", "ModelRunner", "resolve", "resolve"),
             ("minillm.engine.output_processor", "OutputProcessor", "process", "outputs"),
             ("minillm.structured.rows", "GrammarRows", "masks", "masks"),
             ("minillm.structured.rows", "GrammarRows", "_work", "masks_work"),
             ("minillm.structured.rows", "GrammarRows", "_queue_waits", "masks_queue"),
             ("minillm.structured.rows", "GrammarRows", "settle", "masks_settle"),
             ("minillm.structured.rows", "GrammarRows", "publish", "masks_publish"),
             ("minillm.structured.mask_worker", "MaskWorker", "fill", "masks_send"),
             ("minillm.structured.mask_worker", "MaskWorker", "ring", "masks_ring"))

    def __init__(self):
        self.blocked = 0.0
        self.parts: dict[str, float] = {}

    @property
    def masks(self) -> float:
        return self.parts.get("masks", 0.0)

    def blocking(self, fn):
        """fn, its wall time counted as blocked."""
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.blocked += time.perf_counter() - t0
        return timed

    def part(self, name: str, fn):
        """fn, its wall time less what it spent blocked counted as part `name`."""
        self.parts.setdefault(name, 0.0)

        def timed(*a, **kw):
            t0, b0 = time.perf_counter(), self.blocked
            try:
                return fn(*a, **kw)
            finally:
                self.parts[name] += time.perf_counter() - t0 - (self.blocked - b0)
        return timed

    def in_masks(self, fn):
        return self.part("masks", fn)

    def install(self) -> None:
        import importlib

        from minillm.structured import mask_worker

        torch.cuda.Event.synchronize = self.blocking(torch.cuda.Event.synchronize)
        mask_worker.MaskWorker._answer = self.blocking(mask_worker.MaskWorker._answer)
        mask_worker.MaskWorker.settle_ring = self.blocking(mask_worker.MaskWorker.settle_ring)
        for module, cls, method, name in self.PARTS:
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, method, self.part(name, getattr(owner, method)))

    def read(self) -> tuple[float, dict[str, float]]:
        return self.blocked, dict(self.parts)


HOST = HostClock()
PLACEMENT = False   # --placement: its sampling thread takes the GIL every few ms, which the engine thread then waits for


class Placement:
    """Which CPU the engine's main thread and each mask worker last ran on, sampled every few ms by a thread:
    whether a slow process had its worker on the main thread's core (an SMT sibling) or another NUMA node."""

    def __init__(self, worker_pids):
        import threading
        from collections import Counter

        self.pids = {"engine": f"/proc/self/task/{threading.get_native_id()}/stat"}
        self.pids.update({f"worker{k}": f"/proc/{pid}/stat" for k, pid in enumerate(worker_pids) if pid})
        self.seen = {name: Counter() for name in self.pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.003):
            for name, path in self.pids.items():
                try:
                    self.seen[name][int(Path(path).read_text().rsplit(")", 1)[1].split()[36])] += 1
                except (OSError, ValueError, IndexError):
                    pass

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        out = {}
        for name, seen in self.seen.items():
            if seen:
                cpu, n = seen.most_common(1)[0]
                out[f"{name}_cpu"] = cpu
                out[f"{name}_cpu_share"] = n / sum(seen.values())
                out[f"{name}_core"] = _core_of(cpu)
        return out


def _core_of(cpu: int) -> str:
    """'package/core' of a logical CPU, from sysfs (two logical CPUs with the same value are SMT siblings)."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return f"{(base / 'physical_package_id').read_text().strip()}/{(base / 'core_id').read_text().strip()}"
    except OSError:
        return "?"


def run_mode(llm: LLM, batch: int, constrained: int, steps: int, spec, prof_steps: int = 0, seeded: bool = False,
             temperature: float = 1.0):
    """Step times (s) of steps where all `batch` rows decode; with prof_steps, a profiler over that many."""
    rng = random.Random(batch)
    for i in range(batch):
        kw = dict(temperature=temperature, max_tokens=steps + 8, seed=i if seeded else None)
        params = SamplingParams(structured=spec, min_tokens=steps + 8, **kw) if i < constrained else \
            SamplingParams(ignore_eos=True, **kw)
        llm.add_request([rng.randrange(1000, 100000) for _ in range(32)], params)
    times, prof = [], None
    runner, events = llm.engine.runner, None
    cpu0, nsteps = cpu_counters(llm), 0
    blocked, parts = 0.0, {}
    worker = getattr(runner.grammar, "_worker", None)
    place = Placement([p.pid for p in getattr(worker, "procs", [])]) if constrained and PLACEMENT else None
    while llm.has_unfinished_requests():
        full = llm.stats().num_running == batch
        if full and events is None and len(times) == 2 and torch.cuda.is_available():
            events = runner.step_events = []   # each resolved step's timing events (ModelRunner.step_events)
        elif not full:
            runner.step_events = None
        if full and prof_steps and prof is None and len(times) >= 8:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_start, prof_n = time.perf_counter(), 0
        t0, (b0, p0) = time.perf_counter(), HOST.read()
        llm.step()
        nsteps += 1
        if full:
            times.append(time.perf_counter() - t0)
            b1, p1 = HOST.read()
            if len(times) > 2:   # as times[2:] below
                blocked += b1 - b0
                for k, v in p1.items():
                    parts[k] = parts.get(k, 0.0) + v - p0.get(k, 0.0)
        if prof is not None and prof_n is not None:
            prof_n += 1
            if prof_n == prof_steps:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                wall = time.perf_counter() - prof_start
                prof.__exit__(None, None, None)
                prof_n = None
                prof = (prof, wall)
    if prof is not None and not isinstance(prof, tuple):   # the batch thinned out before the profile ended
        prof.__exit__(None, None, None)
        prof = None
    runner.step_events = None
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_counters(llm).items()}
    cpu["steps"] = nsteps
    timed = times[2:]
    if timed:
        cpu["host_busy_ms_per_step"] = (sum(timed) - blocked) / len(timed) * 1e3
        cpu["host_masks_ms_per_step"] = parts.get("masks", 0.0) / len(timed) * 1e3
        cpu["host_parts_ms_per_step"] = {k: v / len(timed) * 1e3 for k, v in parts.items()}
    if place is not None:
        cpu.update(place.stop())
    return timed, prof, events, cpu   # the first full steps still carry prefill leftovers


def cpu_counters(llm: LLM) -> dict:
    """CPU seconds and involuntary context switches of this process (every thread) and of the mask worker
    process, if one runs: a step that is slow in one process and fast in the next with the same CPU seconds was
    waiting for a core."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"engine_cpu_s": ru.ru_utime + ru.ru_stime, "engine_invol_switches": float(ru.ru_nivcsw)}
    worker = getattr(llm.engine.runner.grammar, "_worker", None)
    for proc in getattr(worker, "procs", []):   # summed over the worker processes
        if not proc.pid or not Path(f"/proc/{proc.pid}/stat").exists():
            continue
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out["worker_cpu_s"] = out.get("worker_cpu_s", 0.0) + cpu
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches"):
                out["worker_invol_switches"] = out.get("worker_invol_switches", 0.0) + float(line.split()[1])
    return out


def gpu_timeline(events) -> dict:
    """The GPU's time over consecutive full steps, from the runner's timing events (launch, forward done, sampler
    start, tokens copied) without a profiler's overhead: busy = forward + sampler spans; stall = forward done to
    sampler start (the wait for the step's bitmask, on the stream or for the host's late launch); gap = tokens
    copied to the next step's forward (its input copies, and a host that queued it late)."""
    if len(events) < 3:
        return {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    fwd = [s.elapsed_time(f) for s, f, _, _ in events]
    stall = [f.elapsed_time(m) for _, f, m, _ in events]
    smp = [m.elapsed_time(d) for _, _, m, d in events]
    gap = [a[3].elapsed_time(b[0]) for a, b in zip(events, events[1:])]
    span = events[0][0].elapsed_time(events[-1][3])
    med = statistics.median
    return {"gpu_steps": len(events), "gpu_span_ms": span, "gpu_busy_fraction_events": (sum(fwd) + sum(smp)) / span,
            "gpu_forward_ms_median": med(fwd), "gpu_mask_stall_ms_median": med(stall),
            "gpu_sampler_ms_median": med(smp), "gpu_gap_ms_median": med(gap)}


def summarise(prof, wall: float, path: Path) -> dict:
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events)
    table = events.table(sort_by="self_cuda_time_total", row_limit=25)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"GPU busy {busy_us / 1e3:.2f} ms of {wall * 1e3:.2f} ms wall\n\n{table}\n")
    return {"gpu_busy_ms": busy_us / 1e3, "wall_ms": wall * 1e3, "gpu_busy_fraction": busy_us / 1e6 / wall,
            "profile_table": str(path)}


def write_host_profile(cprof, path: Path) -> None:
    """The constrained run's host time: the runner's launch and what building the masks called."""
    buf = io.StringIO()
    stats = pstats.Stats(cprof, stream=buf).sort_stats("cumulative")
    stats.print_stats(30)
    stats.print_callees("masks|_advance_all|_fill|_min_tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())


def host_path(model_dir: str, batch: int, spec, cfg, host_ms: float, serial: bool, steps: int = 64) -> list[float]:
    """The grammar's share of the host's critical path, without an engine: every row constrained, each step
    hands its rows over (GrammarRows.masks), does host_ms of stand-in host work that calls into torch (as the
    engine's does, releasing the GIL), then waits for the mask. Returns the main thread's seconds per step in
    masks() plus that wait; the sampled token is a random allowed one."""
    from types import SimpleNamespace

    import numpy as np
    from minillm.structured.rows import GrammarRows, PendingMask

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rows = GrammarRows(model_dir, vocab, cfg, torch.device("cpu"), batch, defer=not serial,
                       worker=cfg.mask_worker is True)
    rows._to_device = lambda host: host      # a GPU's non_blocking copy costs the host next to nothing
    reqs = [SimpleNamespace(req_id=f"r{i}", request_id=f"r{i}", prompt_token_ids=[1], all_token_ids=[1],
                            num_prompt_tokens=1, eos_token_ids=[vocab - 1],
                            sampling_params=SimpleNamespace(structured=spec, stop_token_ids=[], ignore_eos=False,
                                                            min_tokens=steps + 8)) for i in range(batch)]
    rows.update(SimpleNamespace(finished_ids=[], new_requests=reqs))
    rng, x, times = np.random.default_rng(0), torch.zeros(4), []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            mask = rows.masks(reqs, [len(r.all_token_ids) for r in reqs], None)
            t1 = time.perf_counter()
            while time.perf_counter() < t1 + host_ms / 1e3:
                x.add_(1)
            t2 = time.perf_counter()
            mask = mask.result() if isinstance(mask, PendingMask) else mask
            times.append(t1 - t0 + time.perf_counter() - t2)
            bits = np.unpackbits(mask.bitmask.numpy().view(np.uint8), bitorder="little").reshape(batch, -1)
            for i, r in enumerate(reqs):
                r.all_token_ids.append(int(rng.choice(np.flatnonzero(bits[i, :vocab]))))
    finally:
        rows.close()
    return times[4:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--seeded", action="store_true", help="give every request a seed")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="0 on a CPU with --stub-model: the sampler's passes over [B, V] would hide the rest")
    ap.add_argument("--mask-threads", type=int, default=None, help="structured.mask_threads (default: config)")
    ap.add_argument("--mask-worker", action="store_true", help="structured.mask_worker: the matchers in a process")
    ap.add_argument("--mask-wait", choices=("auto", "host"), default="auto",
                    help="structured.mask_wait: auto = on CUDA the stream waits for each bitmask on a host flag;"
                         " host = the host launches the sampler once the fill is in (the A/B of the GPU wait)")
    ap.add_argument("--serial-masks", action="store_true",
                    help="structured.overlap_masks false: each step waits for its masks at once (no overlap)")
    ap.add_argument("--stub-model", action="store_true",
                    help="a one-layer model whose forward and LM head return fixed tensors (scripts/bench_host_step.py):"
                         " the host's share of a step alone, e.g. on a CPU")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile the all-constrained run at the largest B: the host time of building its masks")
    ap.add_argument("--host-path", type=float, default=None, metavar="MS",
                    help="no engine: the grammar's time on the host's critical path per step, around MS ms of other"
                         " host work (every row constrained; thread, or --mask-worker, and --serial-masks)")
    ap.add_argument("--mask-workers", type=int, default=None, help="structured.mask_workers (default: config)")
    ap.add_argument("--host-threads", default=None, help="runtime.host_threads (default: config)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the three modes this many times, interleaved, after an untimed warm-up (with > 1);"
                         " each line pools every round's steps")
    ap.add_argument("--placement", action="store_true",
                    help="sample which CPUs the engine thread and the mask workers run on (a thread of its own)")
    ap.add_argument("--modes", default="none,all,mixed", help="which of the three modes to run (e.g. for a profiler)")
    ap.add_argument("--out", default="results/structured.jsonl")
    args = ap.parse_args()
    HOST.install()
    global PLACEMENT
    PLACEMENT = args.placement
    batches = [int(b) for b in args.batches.split(",")]
    model = args.model or str(synthetic_model_dir(Path(tempfile.mkdtemp()) / "qwen3-0.6b-synthetic",
                                                   tiny=args.stub_model))
    if args.host_path is not None:
        return main_host_path(args, batches, model)
    extra = {} if args.mask_threads is None else {"structured_mask_threads": args.mask_threads}
    extra["structured_mask_worker"] = args.mask_worker   # explicit: "auto" would pick the worker on CUDA
    extra["structured_mask_wait"] = args.mask_wait
    if args.serial_masks:
        extra["structured_overlap_masks"] = False
    if args.mask_workers is not None:
        extra["structured_mask_workers"] = args.mask_workers
    if args.host_threads is not None:
        extra["host_threads"] = args.host_threads if args.host_threads == "auto" else int(args.host_threads)
    llm = LLM(model, load_format="dummy" if args.model is None else "auto", max_num_seqs=max(batches),
              max_model_len=1024, **extra)
    mask_threads = llm.engine.cfg.structured.mask_threads
    if args.stub_model:
        stub_model(llm)
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}})
    llm.compile_grammar(spec).result()
    for b in batches:
        modes = tuple((m, n) for m, n in (("none", 0), ("all", b), ("mixed", b // 2)) if m in args.modes.split(","))
        pooled = {mode: ([], [], []) for mode in ("none", "all", "mixed")}
        if args.rounds > 1:   # untimed: the first steps of a process (clocks, caches, the worker) run slower
            run_mode(llm, b, b, 16, spec)
        for rnd in range(args.rounds):   # modes interleaved, so drift between rounds hits every mode alike
            for mode, constrained in modes:
                last = rnd == args.rounds - 1
                prof_steps = args.profile_steps if args.profile and b == max(batches) and last else 0
                host = args.host_profile and b == max(batches) and mode == "all" and last
                if host:
                    cprof = cProfile.Profile()
                    cprof.enable()
                times, prof, events, cpu = run_mode(llm, b, constrained, args.steps, spec, prof_steps,
                                                    args.seeded, args.temperature)
                if host:
                    cprof.disable()
                    write_host_profile(cprof, Path(f"results/profiles/structured_host_B{b}.txt"))
                pooled[mode][0].extend(times)
                pooled[mode][2].append(cpu)
                if events:
                    pooled[mode][1].append(gpu_timeline(events))
                if last:
                    report(args, llm, b, mode, constrained, pooled, mask_threads, host, prof)


def report(args, llm, b, mode, constrained, pooled, mask_threads, host, prof) -> None:
    """One results line per mode: the median over every round's timed steps, against the unconstrained one."""
    times, timelines, cpus = pooled[mode]
    med = statistics.median(times) if times else None
    base = statistics.median(pooled["none"][0]) if pooled["none"][0] else None
    line = {"kind": "structured_overhead", "engine": "minillm", "label": f"B{b}-{mode}", "batch": b,
            "constrained_rows": constrained, "model": args.model or "qwen3-0.6b-synthetic-vocab",
            "seeded": args.seeded, "temperature": args.temperature, "mask_threads": mask_threads,
            "mask_worker": args.mask_worker, "mask_wait": args.mask_wait,
            "mask_workers": llm.engine.cfg.structured.mask_workers,
            "gpu_waits_for_masks": llm.engine.runner.grammar.gpu_wait,
            "serial_masks": args.serial_masks, "stub_model": args.stub_model,
            "host_profiled": host, "rounds": args.rounds, "host_threads": torch.get_num_threads(),
            "steps_timed": len(times), "step_ms_median": None if med is None else med * 1e3,
            "overhead_vs_unconstrained": None if med is None or not base else med / base - 1}
    steps = sum(c["steps"] for c in cpus)
    for key in sorted({k for c in cpus for k in c if k != "steps" and k.endswith(("_s", "_switches"))}):
        # per step() of the mode's runs, prefill included
        line[f"{key}_per_step"] = sum(c.get(key, 0.0) for c in cpus) / steps
    for key in ("host_busy_ms_per_step", "host_masks_ms_per_step"):   # timed steps, median over rounds
        if any(key in c for c in cpus):
            line[key] = statistics.median(c[key] for c in cpus if key in c)
    parts = [c["host_parts_ms_per_step"] for c in cpus if "host_parts_ms_per_step" in c]
    if parts:
        line["host_parts_ms_per_step"] = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in parts[0]}
    if "engine_cpu" in cpus[-1]:   # where the last round ran
        line["placement"] = {k: v for k, v in cpus[-1].items() if k.startswith(("engine_c", "worker")) and
                             not k.endswith(("_s", "_switches"))}
    line["loadavg"] = os.getloadavg()[0]
    timelines = [t for t in timelines if t]
    if timelines:   # per round, then the median over rounds
        line.update({k: statistics.median(t[k] for t in timelines) for k in timelines[0]})
        line["gpu_steps"] = sum(t["gpu_steps"] for t in timelines)
    if isinstance(prof, tuple):
        line.update(summarise(prof[0], prof[1], Path(f"results/profiles/structured_B{b}_{mode}.txt")))
    append_jsonl(args.out, line)
    print(json.dumps({k: v for k, v in line.items() if k != "profile_table"}))


def main_host_path(args, batches, model: str) -> None:
    from minillm.config import StructuredConfig

    cfg = StructuredConfig(mask_worker=args.mask_worker,
                           **({} if args.mask_threads is None else {"mask_threads": args.mask_threads}))
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}})
    for b in batches:
        times = host_path(model, b, spec, cfg, args.host_path, args.serial_masks, args.steps)
        where = "worker" if args.mask_worker else "serial" if args.serial_masks else "thread"
        line = {"kind": "structured_host_path", "label": f"B{b}-all-{where}", "batch": b, "masks": where,
                "mask_threads": cfg.mask_threads, "host_work_ms": args.host_path, "steps_timed": len(times),
                "grammar_ms_median": statistics.median(times) * 1e3,
                "grammar_ms_p90": sorted(times)[int(0.9 * len(times))] * 1e3}
        append_jsonl(args.out, line)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
