"""Async scheduling (host work of step N+1 overlapping the GPU work of step N) must not change a single token
or event: same outputs as synchronous stepping, stops caught one step late but never emitted past."""
import random

import pytest

from minillm import LLM, SamplingParams
from tiny_models import make_tiny_checkpoint

MAX_LEN = 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async"), vocab=256, seed=11)


def prompts(seed=0, lens=(1, 5, 16, 17, 33, 40)):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lens]


def run(path, prompts_, params, async_on, **kw):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True,
              async_scheduling=async_on, **kw)
    outs = llm.generate(prompts_, params, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()
    return llm, [(o.token_ids, o.finish_reason) for o in outs]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 14, "max_num_batched_tokens": 32},
                                {"enable_chunked_prefill": False, "max_num_batched_tokens": 64}])
def test_greedy_same_tokens(ckpt, kw):
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
    sync_llm, sync = run(ckpt, prompts(), sp, False, **kw)
    async_llm, got = run(ckpt, prompts(), sp, True, **kw)
    assert got == sync
    assert async_llm.num_preemptions == sync_llm.num_preemptions


def test_seeded_sampling_same_tokens(ckpt):
    sp = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=15, ignore_eos=True, min_tokens=3)
          for s in range(6)]
    assert run(ckpt, prompts(1), sp, True)[1] == run(ckpt, prompts(1), sp, False)[1]


def test_value_dependent_stops_not_overshot(ckpt):
    """A stop token is only known once its step resolves; the step already launched behind it must not add a
    token to the output."""
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
    _, base = run(ckpt, prompts(2), greedy, False)
    stops = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20, stop_token_ids=[toks[4]])
             for toks, _ in base]
    _, sync = run(ckpt, prompts(2), stops, False)
    _, got = run(ckpt, prompts(2), stops, True)
    assert got == sync
    assert all(reason == "stop" and len(toks) <= 5 for toks, reason in got)


def test_penalties_fall_back_to_synchronous_steps(ckpt):
    sp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, repetition_penalty=1.3 if i % 2 else 1.0)
          for i in range(6)]
    assert run(ckpt, prompts(3), sp, True)[1] == run(ckpt, prompts(3), sp, False)[1]


def test_streamed_events_and_abort(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True,
              async_scheduling=True)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)
    ids = [llm.add_request(p, sp) for p in prompts(4)[:3]]
    streamed = {i: [] for i in ids}
    finals = {}
    steps = 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            assert -1 not in o.new_token_ids
            streamed[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
        steps += 1
        if steps == 1:
            assert llm.engine._inflight is not None    # the step just launched is still unresolved
        if steps == 4:
            llm.abort(ids[1])
    assert set(finals) == set(ids) and finals[ids[1]].finish_reason == "abort"
    for i in ids:
        assert streamed[i] == finals[i].output.token_ids
    assert len(finals[ids[0]].output.token_ids) == 10
