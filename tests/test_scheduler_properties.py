"""Property test: random add / step / abort sequences against every scheduler configuration.

A fake runner samples random tokens from a tiny vocabulary (so prompts share prefixes and hit EOS / stop ids),
the KV pool is small enough to force preemption, and the invariants are checked after every operation.
"""
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.contract import ModelRunnerOutput
from minillm.engine.scheduler import Scheduler
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from sched_strategies import make_scheduler as shared_make_scheduler
from sched_strategies import scheduler_configs, scripts

BS = 8
PROMPT_VOCAB = 3     # tiny: prompts share prefixes, so prefix-cache hits are common
SAMPLE_VOCAB = 16    # sampled tokens: EOS (0) and the stop id (3) each come up 1 time in 16
MAX_MODEL_LEN = 48

configs = scheduler_configs(num_blocks=(3, 10), budget=(1, 40), max_num_seqs=(1, 6), thresholds=[0, 0, 3, 9])

requests = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, PROMPT_VOCAB - 1), min_size=1, max_size=30),
    "max_tokens": st.integers(1, 18),
    "priority": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.sampled_from([[], [3]]),
})

ops = scripts(requests, max_size=60)


def row_tuples(sched: Scheduler, out):
    """The rows with the scheduler's Request of each (call between schedule() and update())."""
    return list(zip([sched.get_request(rid) for rid in out.req_ids], out.starts, out.num_tokens, out.sample))


def check_step_output(sched: Scheduler, out) -> None:
    assert out.num_batched_tokens == sum(out.num_tokens) <= sched.config.max_num_batched_tokens
    lens = out.num_tokens
    assert lens == sorted(lens, key=lambda n: n != 1)
    assert len(out.req_ids) == len(out.starts) == len(lens) == len(out.sample)
    seen = set()
    for r, start, n, sample in row_tuples(sched, out):
        assert r.request_id not in seen and r.request_id not in out.preempted_ids
        seen.add(r.request_id)
        assert start == r.num_computed_tokens and 1 <= n <= r.num_tokens - start
        assert len(r.block_ids) * BS >= start + n          # KV slots exist for every row
        assert sample == (start + n == r.num_tokens)


def check_kv_reads(sched: Scheduler, out, kv_store: dict[int, tuple[int, ...]]) -> None:
    """Play the runner against a fake paged KV cache: each slot remembers which prefix its token's KV encodes.

    Every row writes its new tokens, then must read back exactly its own prefix at every earlier position:
    this catches a wrong prefix hit, a block reused while still referenced, and reads of unwritten slots.
    """
    rows = row_tuples(sched, out)
    for r, start, n, _ in rows:
        for t in range(start, start + n):
            kv_store[r.block_ids[t // BS] * BS + t % BS] = tuple(r.all_token_ids[:t + 1])
    for r, start, n, _ in rows:
        for t in range(start + n):
            assert kv_store.get(r.block_ids[t // BS] * BS + t % BS) == tuple(r.all_token_ids[:t + 1]), \
                f"{r.request_id} reads foreign KV at position {t}"


def check_published_blocks(sched: Scheduler, kv_store: dict[int, tuple[int, ...]]) -> None:
    """A block in the prefix cache must still hold the KV of the tokens it is published under."""
    for block_id, tokens in sched.kv.pool.cached_blocks():
        held = [kv_store.get(block_id * BS + off, (None,))[-1] for off in range(BS)]
        assert held == list(tokens), f"block {block_id} is published for {tokens} but holds {held}"


def run_step(sched: Scheduler, seed: int, kv_store: dict[int, tuple[int, ...]]) -> None:
    out = sched.schedule()
    check_step_output(sched, out)
    check_kv_reads(sched, out, kv_store)
    ids = out.sampled_req_ids()
    tokens = [(seed >> (4 * i) ^ i) % SAMPLE_VOCAB for i in range(len(ids))]
    sched.update(out, ModelRunnerOutput(ids, tokens))
    sched.check_integrity()
    check_published_blocks(sched, kv_store)


def make_scheduler(cfg, cls=Scheduler) -> Scheduler:
    return shared_make_scheduler(cfg, BS, MAX_MODEL_LEN, cls)


def make_request(rid: str, arg) -> Request:
    return Request(rid, arg["prompt"], SamplingParams(max_tokens=arg["max_tokens"], ignore_eos=arg["ignore_eos"],
                                                      stop_token_ids=arg["stop_token_ids"]),
                   eos_token_ids=frozenset({0}), priority=arg["priority"])


@settings(max_examples=60, deadline=None)
@given(cfg=configs, script=ops)
def test_random_workloads_keep_invariants_and_drain(cfg, script):
    sched = make_scheduler(cfg)
    added, kv_store = [], {}
    for op, arg in script:
        if op == "add":
            rid = f"prop-{len(added)}"           # unique ids within the test
            added.append(rid)
            try:
                sched.add_request(make_request(rid, arg))
            except ValueError:
                assert len(arg["prompt"]) + arg["max_tokens"] - 1 > cfg["num_blocks"] * BS
        elif op == "step":
            run_step(sched, arg, kv_store)
        elif added:
            sched.abort(added[arg % len(added)])
            sched.check_integrity()
    # Every accepted request must finish: nothing may wait forever.
    bound = sum(MAX_MODEL_LEN for _ in added) + 10
    for i in range(bound):
        if not sched.has_unfinished_requests():
            break
        run_step(sched, i * 7919, kv_store)
    assert not sched.has_unfinished_requests(), "requests still pending: the scheduler stalled"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and all(c == 0 for c in sched.kv.pool.ref_cnt)
    sched.check_integrity()


class RowByRowScheduler(Scheduler):
    """The scheduler without its plain-decode fast paths: update() always goes row by row, so it never leaves
    schedule() a known decode batch either."""

    def update(self, out, runner_out):
        self._check_runner_output(out, runner_out)
        return self._update_rows(self._scheduled, out, runner_out.sampled_token_ids)


def observable(sched: Scheduler, out, advanced) -> tuple:
    """Everything a step decides or changes that anyone could see."""
    return (list(zip(out.req_ids, out.starts, out.num_tokens, out.sample)), out.preempted_ids,
            out.num_batched_tokens,
            [(r.request_id, r.status, r.stop_reason, r.num_computed_tokens, r.output_token_ids, r.block_ids)
             for r in advanced],
            [r.request_id for r in sched.running], sched.num_preemptions, sched.kv.pool.free_block_ids(),
            sorted(sched.kv.pool.cached_blocks()))


# Workloads that dwell in steps of plain decodes: a few requests at a time that decode for long, short ones
# that come and go, a pool that runs dry mid-decode, and sampled tokens that rarely hit a stop id.
decode_configs = scheduler_configs(num_blocks=(4, 16), budget=(4, 64), max_num_seqs=(2, 8), thresholds=[0, 0, 5])
decode_requests = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, PROMPT_VOCAB - 1), min_size=1, max_size=12),
    "max_tokens": st.sampled_from([1, 2, 3, 12, 24, 36]),
    "priority": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.sampled_from([[], [3]]),
})
decode_ops = scripts(decode_requests, max_size=80, step_weight=2)


@settings(max_examples=200, deadline=None)
@given(cfg=decode_configs, script=decode_ops)
def test_plain_decode_fast_paths_match_row_by_row(cfg, script):
    """Steps of plain decodes take shortcuts in schedule() and update(); they must decide exactly what the
    row-by-row paths decide: same rows, preemptions, blocks, stops and prefix cache. A request is sometimes
    aborted between schedule() and update() (an abort or stop string while its step runs)."""
    scheds = [make_scheduler(cfg), make_scheduler(cfg, RowByRowScheduler)]
    added = []

    def step(seed: int) -> None:
        seen = []
        for sched in scheds:
            out = sched.schedule()
            if out.is_empty:                         # the engine runs no step, so nothing to update
                seen.append(observable(sched, out, []))
                continue
            ids = out.sampled_req_ids()
            if out.req_ids and seed % 5 == 0:
                sched.abort(out.req_ids[seed % len(out.req_ids)])
            # 8x the vocabulary: stop tokens are rare, so that runs of steps end on length too.
            tokens = [(seed >> (4 * i) ^ i) % (8 * SAMPLE_VOCAB) for i in range(len(ids))]
            advanced = sched.update(out, ModelRunnerOutput(ids, tokens))
            sched.check_integrity()
            seen.append(observable(sched, out, advanced))
        assert seen[0] == seen[1]

    for op, arg in script:
        if op == "add":
            rid = f"fast-{len(added)}"
            added.append(rid)
            for sched in scheds:
                try:
                    sched.add_request(make_request(rid, arg))
                except ValueError:
                    pass
        elif op == "step":
            step(arg)
        elif added:
            assert scheds[0].abort(added[arg % len(added)]) == scheds[1].abort(added[arg % len(added)])
    for i in range(sum(MAX_MODEL_LEN for _ in added) + 10):
        if not scheds[0].has_unfinished_requests():
            break
        step(i * 7919 + 1)
    assert not scheds[1].has_unfinished_requests()
