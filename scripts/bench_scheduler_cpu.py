"""CPU cost of one engine step with 256 running decodes of ~1000-token contexts, the model replaced by a stub.

By default it times schedule() + update() (scheduler bookkeeping). With --with-inputs it also times the runner's
host work for the same step: its request states (the plain SchedulerOutput applied, the rows looked up, the sampled
tokens recorded), InputBuilder.build (token ids, positions, slot mapping, block tables,
metadata) and the sampling batch (SamplingBatchCache.get), i.e. everything the CPU does per step except launching
GPU work.
That sum is what the <= 250 us per-step budget of docs/architecture.md (section 7) is about.

    python scripts/bench_scheduler_cpu.py [--requests 256] [--context 1000] [--steps 3000] [--prefix-caching]
                                          [--with-inputs]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from minillm.config import CacheConfig, SchedulerConfig
from itertools import compress

from minillm.contract import ModelRunnerOutput
from minillm.engine.scheduler import Scheduler
from minillm.request import Request
from minillm.sampling_params import SamplingParams


def build(num_requests: int, context: int, steps: int, caching: bool, block_size: int = 16) -> Scheduler:
    """A scheduler whose requests have all finished prefill and will keep decoding for `steps` steps."""
    max_model_len = context + steps + 2 * block_size
    blocks_per_req = -(-max_model_len // block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=16384),
                      CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                      num_blocks=num_requests * blocks_per_req, max_model_len=max_model_len)
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(100_000) for _ in range(context + rng.randrange(-16, 17))]
        sched.add_request(Request(f"bench-{i}", prompt, SamplingParams(max_tokens=steps + block_size, ignore_eos=True)))
    # Prefill everything (not timed) so that every timed step is a pure decode step.
    while any(r.num_output_tokens == 0 for r in sched.running) or sched.num_waiting:
        step(sched, rng)
    return sched


def step(sched: Scheduler, rng: random.Random) -> None:
    out = sched.schedule()
    ids = out.sampled_req_ids()
    sched.update(out, ModelRunnerOutput(ids, [rng.randrange(100_000) for _ in ids]))


def runner_host_work(max_num_seqs: int, max_model_len: int, block_size: int):
    """The runner's per-step host work on the CPU device: inputs + metadata, then the sampling batch."""
    import torch

    from minillm.runner.input_batch import InputBuilder
    from minillm.runner.request_state import RequestStates
    from minillm.sampling.batch import SamplingBatchCache

    from minillm.runner.input_batch import PrevTokens

    inputs = InputBuilder(max_num_seqs, 16384, max_model_len, block_size, torch.device("cpu"))
    sampling = SamplingBatchCache("cpu", 151936)
    states = RequestStates()
    in_flight = []

    def run(out, tokens: list[int], token_tensor) -> None:
        # ModelRunner.launch() of this step and resolve() of the one before, as async scheduling runs them; the
        # model and the sampler's device work left out.
        inputs.release(states.apply(out))
        reqs = states.rows(out.req_ids)
        prev = PrevTokens(in_flight[0][1], in_flight[0][2]) if in_flight else None
        step = inputs.build(out, reqs, prev)
        sampled = reqs if all(out.sample) else list(compress(reqs, out.sample))
        sampling.get(sampled, step.meta.seq_lens_cpu)
        if in_flight:
            states.append_sampled(in_flight[0][0], in_flight[0][3])
        in_flight[:] = [(sampled, token_tensor, out.sampled_req_ids(), tokens)]
    return run


def _introduce_all(sched: Scheduler, out):
    """`out` as the runner's first message: every row's request as new, with all its tokens and blocks (the
    prefill steps before were not shown to the runner)."""
    from minillm.contract import NewRequestData

    reqs = [sched.get_request(rid) for rid in out.req_ids]
    out.new_requests = [NewRequestData(r.request_id, list(r.all_token_ids), r.sampling_params, r.eos_token_ids,
                                       list(r.block_ids)) for r in reqs]
    out.new_block_ids = {}
    return out


def python_loop_ns() -> float:
    """ns per empty `for` iteration: a yardstick for how fast this CPU runs Python (~15-25 ns on a fast idle
    core), so figures from different or busy machines can be compared."""
    t0 = time.perf_counter()
    for _ in range(2_000_000):
        pass
    return (time.perf_counter() - t0) / 2_000_000 * 1e9


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--prefix-caching", action="store_true", help="publish full blocks to the prefix cache")
    ap.add_argument("--with-inputs", action="store_true", help="also time the runner's input + sampling-batch build")
    args = ap.parse_args()
    sched = build(args.requests, args.context, args.steps, args.prefix_caching)
    host_inputs = runner_host_work(args.requests, sched.max_model_len, 16) if args.with_inputs else None
    rng = random.Random(1)
    # The fake runner output is built outside the timed region: only schedule() + update() are measured.
    times = []
    for i in range(args.steps):
        tokens = [rng.randrange(100_000) for _ in range(args.requests)]
        token_tensor = torch.tensor(tokens)   # the sampled ids on the "device"
        t0 = time.perf_counter()
        out = sched.schedule()
        if host_inputs is not None:
            # The runner first hears of the requests in this first timed step (they were prefilled untimed).
            host_inputs(out if i else _introduce_all(sched, out), tokens, token_tensor)
        t1 = time.perf_counter()
        runner_out = ModelRunnerOutput(out.req_ids, tokens)
        t2 = time.perf_counter()
        sched.update(out, runner_out)
        t3 = time.perf_counter()
        assert len(out.req_ids) == args.requests and out.num_decodes == args.requests
        times.append((t1 - t0) + (t3 - t2))
    med = statistics.median(times) * 1e6
    p90 = statistics.quantiles(times, n=10)[-1] * 1e6
    best = min(times) * 1e6      # least disturbed by other processes on a shared machine
    what = "schedule()+inputs+update()" if args.with_inputs else "schedule()+update()"
    print(f"{what}: {args.requests} decodes, ~{args.context}-token contexts, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}: median {med:.1f} us/step, "
          f"p90 {p90:.1f}, min {best:.1f} us "
          f"over {args.steps} steps (this CPU: {python_loop_ns():.0f} ns per empty Python loop iteration)")


if __name__ == "__main__":
    main()
