"""Scheduler driven with a fake runner: budget, chunk boundaries, ordering, policies, preemption, abort, stops.

Every test ends with the engine-empty check: no request anywhere, every refcount 0, all blocks free.
"""
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.config import CacheConfig, SchedulerConfig
from minillm.contract import ModelRunnerOutput, SchedulerOutput
from minillm.engine.scheduler import Scheduler
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams

BS = 8
_token_base = itertools.count(1000, 1000)   # distinct prompt contents unless a test wants shared prefixes


def make_sched(num_blocks=64, max_model_len=128, caching=True, **sched_kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**sched_kw), CacheConfig(block_size=BS, enable_prefix_caching=caching),
                     num_blocks, max_model_len)


def make_req(rid, prompt, max_tokens=4, priority=0, eos=(), **sp) -> Request:
    tokens = list(range(next(_token_base), 0, -1))[:prompt] if isinstance(prompt, int) else list(prompt)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids=frozenset(eos),
                   priority=priority)


def rows(out: SchedulerOutput):
    return list(zip(out.req_ids, out.starts, out.num_tokens, out.sample))


def step(s: Scheduler, token=1):
    """One engine step with a fake runner; checks the output contract and the invariants."""
    out = s.schedule()
    assert out.num_batched_tokens == sum(out.num_tokens) <= s.config.max_num_batched_tokens
    lens = out.num_tokens
    assert lens == sorted(lens, key=lambda n: n != 1), "single-token rows must come first"
    assert len(out.req_ids) == len(out.starts) == len(lens) == len(out.sample)
    for rid, start, n, sample in zip(out.req_ids, out.starts, lens, out.sample):
        r = s.get_request(rid)
        assert start == r.num_computed_tokens and n >= 1
        assert sample == (start + n == r.num_tokens)
    ids = out.sampled_req_ids()
    toks = [token(rid) if callable(token) else token for rid in ids]
    advanced = s.update(out, ModelRunnerOutput(ids, toks))
    s.check_integrity()
    return out, advanced


def drain(s: Scheduler, max_steps=200, token=1) -> int:
    n = 0
    while s.has_unfinished_requests():
        step(s, token)
        n += 1
        assert n <= max_steps, "scheduler made no progress"
    return n


def assert_empty(s: Scheduler) -> None:
    assert not s.has_unfinished_requests() and s.num_running == 0 and s.num_waiting == 0
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert all(c == 0 for c in s.kv.pool.ref_cnt) and not s.kv._state
    s.check_integrity()


def test_budget_splits_a_prompt_into_chunks():
    s = make_sched(max_num_batched_tokens=8)
    a = make_req("chunk-a", 20, max_tokens=2)
    s.add_request(a)
    assert rows(step(s)[0]) == [("chunk-a", 0, 8, False)]
    assert rows(step(s)[0]) == [("chunk-a", 8, 8, False)]
    out, advanced = step(s)
    assert rows(out) == [("chunk-a", 16, 4, True)] and advanced == [a]
    assert rows(step(s)[0]) == [("chunk-a", 20, 1, True)]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 2
    assert_empty(s)


def test_decodes_first_then_partial_prefills_then_new_prompts():
    s = make_sched(max_num_batched_tokens=16)
    for rid in ("ord-a", "ord-b"):
        s.add_request(make_req(rid, 3, max_tokens=5))
    assert rows(step(s)[0]) == [("ord-a", 0, 3, True), ("ord-b", 0, 3, True)]
    s.add_request(make_req("ord-c", 30, max_tokens=1))
    assert rows(step(s)[0]) == [("ord-a", 3, 1, True), ("ord-b", 3, 1, True), ("ord-c", 0, 14, False)]
    s.add_request(make_req("ord-d", 5, max_tokens=1))
    out = step(s)[0]
    assert rows(out) == [("ord-a", 4, 1, True), ("ord-b", 4, 1, True), ("ord-c", 14, 14, False)]
    assert out.num_decodes == 2 and s.num_waiting == 1
    assert rows(step(s)[0]) == [("ord-a", 5, 1, True), ("ord-b", 5, 1, True), ("ord-c", 28, 2, True),
                                ("ord-d", 0, 5, True)]
    drain(s)
    assert_empty(s)


def test_single_token_rows_go_first_even_when_admitted_last():
    s = make_sched(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    s.add_request(make_req("one-a", 30, max_tokens=1))
    step(s)
    s.add_request(make_req("one-b", 1, max_tokens=1))
    out = step(s)[0]
    assert rows(out) == [("one-b", 0, 1, True), ("one-a", 8, 8, False)] and out.num_decodes == 1
    drain(s)
    assert_empty(s)


def test_long_prefill_token_threshold_caps_each_chunk():
    s = make_sched(max_num_batched_tokens=16, long_prefill_token_threshold=3)
    for rid in ("cap-a", "cap-b"):
        s.add_request(make_req(rid, 10, max_tokens=1))
    for start in (0, 3, 6):
        assert rows(step(s)[0]) == [("cap-a", start, 3, False), ("cap-b", start, 3, False)]
    assert rows(step(s)[0]) == [("cap-a", 9, 1, True), ("cap-b", 9, 1, True)]
    assert_empty(s)


@pytest.mark.parametrize("policy, order", [
    ("fcfs", ["p5", "p1", "p3", "p1b"]),
    ("priority", ["p1", "p1b", "p3", "p5"]),      # lower value first, ties by arrival
])
def test_admission_order_by_policy(policy, order):
    s = make_sched(max_num_seqs=1, policy=policy)
    for rid, prio in (("p5", 5), ("p1", 1), ("p3", 3), ("p1b", 1)):
        s.add_request(make_req(rid, 2, max_tokens=1, priority=prio))
    finished = [r.request_id for _ in range(4) for r in step(s)[1]]
    assert finished == order
    assert_empty(s)


def test_max_num_seqs_limits_running_requests():
    s = make_sched(max_num_seqs=2)
    for i in range(5):
        s.add_request(make_req(f"seqs-{i}", 4, max_tokens=3))
    while s.has_unfinished_requests():
        step(s)
        assert s.num_running <= 2
    assert_empty(s)


def test_prefill_first_keeps_prefills_and_decodes_apart():
    s = make_sched(max_num_batched_tokens=16, enable_chunked_prefill=False)
    for rid in ("pf-a", "pf-b"):
        s.add_request(make_req(rid, 10, max_tokens=3))
    assert rows(step(s)[0]) == [("pf-a", 0, 10, True)]            # pf-b does not fit the 6 left: wait
    assert rows(step(s)[0]) == [("pf-b", 0, 10, True)]            # a prompt can be admitted: no decodes
    assert rows(step(s)[0]) == [("pf-a", 10, 1, True), ("pf-b", 10, 1, True)]
    s.add_request(make_req("pf-c", 4, max_tokens=1))
    assert rows(step(s)[0]) == [("pf-c", 0, 4, True)]
    assert rows(step(s)[0]) == [("pf-a", 11, 1, True), ("pf-b", 11, 1, True)]
    assert_empty(s)


def test_prefill_first_runs_an_oversized_prompt_alone_in_budget_chunks():
    s = make_sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add_request(make_req("big-a", 20, max_tokens=2))
    s.add_request(make_req("big-b", 3, max_tokens=2))
    assert rows(step(s)[0]) == [("big-a", 0, 8, False)]
    assert rows(step(s)[0]) == [("big-a", 8, 8, False)]
    assert rows(step(s)[0]) == [("big-a", 16, 4, True), ("big-b", 0, 3, True)]
    assert rows(step(s)[0]) == [("big-a", 20, 1, True), ("big-b", 3, 1, True)]
    assert_empty(s)


def test_static_policy_admits_a_new_batch_only_when_all_finished():
    s = make_sched(max_num_seqs=2, policy="static")
    s.add_request(make_req("st-a", 4, max_tokens=1))
    s.add_request(make_req("st-b", 4, max_tokens=4))
    s.add_request(make_req("st-c", 4, max_tokens=1))
    assert rows(step(s)[0]) == [("st-a", 0, 4, True), ("st-b", 0, 4, True)]
    for pos in (4, 5, 6):                                          # st-a is done, a slot is free, yet
        assert rows(step(s)[0]) == [("st-b", pos, 1, True)]         # st-c waits for the batch to end
    assert rows(step(s)[0]) == [("st-c", 0, 4, True)]
    assert_empty(s)


def test_preemption_frees_the_newest_and_it_resumes_by_recompute():
    s = make_sched(num_blocks=4, max_num_batched_tokens=64)
    a, b = make_req("pre-a", 12, max_tokens=10), make_req("pre-b", 12, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    token_of = lambda rid: 7 if rid == "pre-a" else 9
    step(s, token_of)                                # both prefilled: 2 + 2 blocks, pool full
    for _ in range(4):                               # tokens 12..15 still fit the second block
        assert step(s, token_of)[0].preempted_ids == []
    out = step(s, token_of)[0]                      # pre-a needs a third block at token 16
    assert out.preempted_ids == ["pre-b"] and rows(out) == [("pre-a", 16, 1, True)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    drain(s, token=token_of)
    assert a.output_token_ids == [7] * 10
    assert b.output_token_ids == [9] * 10 and b.status is RequestStatus.FINISHED_LENGTH
    assert_empty(s)


def test_priority_preemption_takes_the_lowest_priority_even_if_older():
    s = make_sched(num_blocks=4, max_num_batched_tokens=64, policy="priority")
    s.add_request(make_req("prio-low", 12, max_tokens=10, priority=2))
    s.add_request(make_req("prio-high", 12, max_tokens=10, priority=0))
    preempted = [rid for _ in range(6) for rid in step(s)[0].preempted_ids]
    assert preempted == ["prio-low"]
    drain(s)
    assert_empty(s)


def test_preempting_a_request_already_scheduled_this_step_unschedules_it():
    # un-a (older) is still prefilling when the newer un-b decodes; un-b's decode was scheduled first.
    s = make_sched(num_blocks=3, max_num_batched_tokens=16, long_prefill_token_threshold=8, caching=False)
    s.add_request(make_req("un-a", 17, max_tokens=1))
    s.add_request(make_req("un-b", 8, max_tokens=2))
    assert rows(step(s)[0]) == [("un-a", 0, 8, False), ("un-b", 0, 8, True)]
    out = step(s)[0]
    assert out.preempted_ids == ["un-b"] and rows(out) == [("un-a", 8, 8, False)]
    assert out.num_batched_tokens == 8                # the decode's token was refunded
    drain(s)
    assert_empty(s)


def test_decodes_short_of_blocks_preempt_one_at_a_time():
    # A step of plain decodes where both need a block and none is free: dry-a preempts dry-b, which then gets
    # neither a block nor a row.
    s = make_sched(num_blocks=2, max_num_batched_tokens=64)
    a, b = make_req("dry-a", 7, max_tokens=4), make_req("dry-b", 7, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)                                          # both prefilled: one block each, pool empty
    assert rows(step(s)[0]) == [("dry-a", 7, 1, True), ("dry-b", 7, 1, True)]   # fills both blocks
    out = step(s)[0]
    assert out.preempted_ids == ["dry-b"] and rows(out) == [("dry-a", 8, 1, True)]
    assert b.status is RequestStatus.WAITING and b.block_ids == [] and len(a.block_ids) == 2
    drain(s)
    assert_empty(s)


def test_plain_decode_steps_stop_any_row_on_its_own_stop_id():
    s = make_sched()
    a, b = make_req("sid-a", 4, max_tokens=10), make_req("sid-b", 4, max_tokens=10, stop_token_ids=[7])
    s.add_request(a)
    s.add_request(b)
    for _ in range(4):
        step(s)
    step(s, token=7)                                 # both sample 7: only sid-b stops on it
    assert b.status is RequestStatus.FINISHED_STOPPED and b.stop_reason == 7 and b.num_output_tokens == 5
    assert a.status is RequestStatus.RUNNING
    drain(s)
    assert a.num_output_tokens == 10
    assert_empty(s)


def test_length_stop_right_after_a_mixed_step():
    # Plain decode steps, one mixed step (a one-token request comes and goes), then len-a's last token.
    s = make_sched()
    a = make_req("len-a", 4, max_tokens=8)
    s.add_request(a)
    for _ in range(6):
        step(s)                                      # the prefill and 5 decodes
    s.add_request(make_req("len-c", 4, max_tokens=1))
    assert rows(step(s)[0]) == [("len-a", 9, 1, True), ("len-c", 0, 4, True)]
    step(s)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 8
    assert_empty(s)


def test_an_idle_schedule_drops_what_the_last_update_left():
    # Regression: an update() of plain decodes leaves its batch (and which of it needs a block) for the next
    # schedule(). If that batch is gone by then and the schedule is empty, the engine runs no update; nothing of
    # the old batch may reach the schedule after.
    s = make_sched()
    s.add_request(make_req("idle-a", 7, max_tokens=8))
    step(s)
    step(s)                                          # fills idle-a's block: its next decode needs a new one
    s.abort("idle-a")
    assert s.schedule().is_empty
    s.add_request(make_req("idle-b", 4))
    drain(s)
    assert_empty(s)


def test_abort_waiting_and_running_requests():
    s = make_sched(max_num_seqs=1)
    a, b = make_req("ab-a", 4, max_tokens=8), make_req("ab-b", 4, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert s.abort("ab-b") and b.status is RequestStatus.FINISHED_ABORTED
    assert s.abort("ab-a") and a.status is RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert not s.abort("ab-a") and not s.abort("ab-unknown")
    with pytest.raises(ValueError, match="finished status"):
        s.finish_request("ab-x", RequestStatus.RUNNING)
    assert_empty(s)


def test_abort_between_schedule_and_update_drops_the_result():
    s = make_sched()
    s.add_request(make_req("mid-a", 4))
    s.add_request(make_req("mid-b", 4))
    out = s.schedule()
    s.abort("mid-a")
    advanced = s.update(out, ModelRunnerOutput(["mid-a", "mid-b"], [1, 1]))
    assert [r.request_id for r in advanced] == ["mid-b"]
    s.check_integrity()
    drain(s)
    assert_empty(s)


@pytest.mark.parametrize("sp, token, n_out, status, reason", [
    (dict(), 5, 1, RequestStatus.FINISHED_STOPPED, None),                         # EOS
    (dict(ignore_eos=True), 5, 6, RequestStatus.FINISHED_LENGTH, None),
    (dict(min_tokens=3), 5, 3, RequestStatus.FINISHED_STOPPED, None),              # EOS only once min reached
    (dict(stop_token_ids=[6]), 6, 1, RequestStatus.FINISHED_STOPPED, 6),
    (dict(stop_token_ids=[6], min_tokens=2), 6, 2, RequestStatus.FINISHED_STOPPED, 6),
    (dict(), 1, 6, RequestStatus.FINISHED_LENGTH, None),                          # max_tokens
])
def test_stop_conditions(sp, token, n_out, status, reason):
    s = make_sched()
    r = make_req("stop-" + "-".join(map(str, sp)) + str(token), 4, max_tokens=6, eos=(5,), **sp)
    s.add_request(r)
    drain(s, token=token)
    assert r.num_output_tokens == n_out and r.status is status and r.stop_reason == reason
    assert_empty(s)


def test_max_model_len_ends_a_request():
    s = make_sched(max_model_len=16)
    r = make_req("len-a", 10, max_tokens=6)
    s.add_request(r)
    drain(s)
    assert r.num_tokens == 16 and r.status is RequestStatus.FINISHED_LENGTH
    assert_empty(s)


def test_update_returns_requests_in_schedule_order_with_finished_ones():
    s = make_sched()
    s.add_request(make_req("ret-a", 4, max_tokens=1))
    s.add_request(make_req("ret-b", 4, max_tokens=2))
    out, advanced = step(s)
    assert [r.request_id for r in advanced] == ["ret-a", "ret-b"]
    assert advanced[0].is_finished and not advanced[1].is_finished
    out = s.schedule()
    with pytest.raises(ValueError, match="does not match"):
        s.update(out, ModelRunnerOutput(["ret-x"], [1]))
    s.abort("ret-b")
    assert_empty(s)


def test_prefix_hit_at_admission_moves_the_counter():
    s = make_sched()
    shared = list(range(500, 517))                   # 17 tokens: two full blocks + 1
    s.add_request(make_req("hit-a", shared[:16], max_tokens=1))
    drain(s)
    b, c = make_req("hit-b", shared[:16], max_tokens=1), make_req("hit-c", shared, max_tokens=1)
    s.add_request(b)
    assert rows(step(s)[0]) == [("hit-b", 8, 8, True)]   # full-prompt hit still computes the last block
    assert b.num_cached_tokens == 8
    s.add_request(c)
    assert rows(step(s)[0]) == [("hit-c", 16, 1, True)]  # 2 blocks hit, 1 token left
    assert c.num_cached_tokens == 16
    assert_empty(s)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=120, max_tokens=9), "exceeds max_model_len=128"),
    (dict(prompt=0), "prompt is empty"),
])
def test_add_request_rejects_requests_that_could_never_run(kwargs, match):
    s = make_sched()
    with pytest.raises(ValueError, match=match):
        s.add_request(make_req("bad-" + match[:6], **kwargs))
    assert_empty(s)


def test_add_request_rejects_a_request_larger_than_the_pool_and_duplicates():
    s = make_sched(num_blocks=2)
    with pytest.raises(ValueError, match="needs 3 KV blocks .* has 2"):
        s.add_request(make_req("pool-a", 16, max_tokens=2))
    s.add_request(make_req("pool-b", 16, max_tokens=1))   # 16 slots: exactly fits
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_req("pool-b", 4))
    drain(s)
    assert_empty(s)


def test_cpu_step_benchmark_runs():
    # The figure itself depends on the machine; CI only checks that the benchmark runs and reports one.
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_scheduler_cpu.py"
    res = subprocess.run([sys.executable, str(script), "--requests", "8", "--context", "40", "--steps", "30",
                          "--prefix-caching", "--with-inputs"], capture_output=True, text=True, timeout=120,
                         check=True)
    assert "schedule()+inputs+update()" in res.stdout and "8 decodes" in res.stdout
    print(res.stdout)
