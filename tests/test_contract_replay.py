"""The scheduler -> runner contract is plain data: record every SchedulerOutput of a randomised engine run, send
each through pickle, replay them into a fresh runner (fresh model, KV cache, sampler) and get the very same
tokens and logprobs, step by step. This is what a tensor-parallel worker or an engine core in another process does.

The run covers what changes the messages: chunked prefill, prefix-cache hits, n > 1 siblings, preemption and
recompute (a small KV pool), stop strings and stop ids, aborts, temperature sampling with and without seeds,
penalties (synchronous steps) and min_tokens, with async scheduling on and off.
"""
import pickle
import random

import pytest

from minillm import LLM, SamplingParams
from minillm.runner.model_runner import ModelRunner

WORDS = "open the file and read each line then close it before the loop ends with a value".split()


def workload(seed: int) -> list[tuple[str, SamplingParams, int | None]]:
    """(prompt, params, step to abort at or None) per request: shared prefixes, every sampling feature."""
    rng = random.Random(seed)
    base = " ".join(rng.choice(WORDS) for _ in range(40))
    out = []
    for i in range(10):
        prompt = base[: rng.randrange(20, len(base))] + " " + " ".join(rng.choice(WORDS) for _ in range(i % 4 * 6))
        kw = dict(max_tokens=rng.randrange(8, 40), temperature=rng.choice([0.0, 0.8, 1.0]))
        kw.update(rng.choice([{}, {"seed": rng.randrange(1000)}, {"n": 2}, {"stop": ["the", "e"]},
                              {"min_tokens": 3, "stop_token_ids": [rng.randrange(4096)]},
                              {"repetition_penalty": 1.3, "presence_penalty": 0.5}, {"logprobs": 3}]))
        out.append((prompt, SamplingParams(**kw), rng.choice([None, None, None, rng.randrange(2, 12)])))
    return out


def record(llm: LLM, work) -> tuple[list[bytes], list]:
    """Run the workload; return the pickled SchedulerOutputs and the runner's outputs, in order."""
    messages, results = [], []
    core = llm.engine.core
    core.recorder = lambda so: messages.append(pickle.dumps(so))
    resolve = core.runner.resolve
    core.runner.resolve = lambda *a, **k: results.append(resolve(*a, **k)) or results[-1]
    ids = {}
    step = 0
    pending = list(enumerate(work))
    while pending or llm.has_unfinished_requests():
        for i, (prompt, params, _) in [p for p in pending if p[0] <= step]:
            ids[i] = llm.add_request(prompt, params)
            pending.remove((i, (prompt, params, _)))
        for i, (_, _, abort_at) in enumerate(work):
            if abort_at == step and i in ids:
                llm.abort(ids[i])
        llm.step()
        step += 1
        assert step < 2000
    return messages, results


@pytest.mark.parametrize("async_on, seed", [(True, 0), (False, 3)])
def test_replayed_scheduler_outputs_give_the_same_tokens(async_on, seed):
    kw = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16, block_size=8,
              max_num_batched_tokens=48, max_num_seqs=6, async_scheduling=async_on, seed=seed)
    llm = LLM(**kw)
    messages, results = record(llm, workload(seed))
    assert llm.num_preemptions > 0, "the workload should preempt (small KV pool)"
    assert not llm.engine.runner.states.by_id, "the runner still holds finished requests"

    runner = ModelRunner(llm.config)          # a fresh model, KV cache and sampler from the same config
    replayed = []
    for blob in messages:
        so = pickle.loads(blob)
        if so.is_empty:
            runner.update_states(so)
        else:
            replayed.append(runner.execute(so))
    assert len(replayed) == len(results)
    for step, (got, want) in enumerate(zip(replayed, results)):
        assert (got.req_ids, got.sampled_token_ids) == (want.req_ids, want.sampled_token_ids), f"step {step}"
        assert got.logprobs == want.logprobs, f"step {step}"
    assert not runner.states.by_id
