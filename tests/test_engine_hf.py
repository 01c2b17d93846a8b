"""End-to-end: the engine's greedy tokens equal HF transformers' (fp32, CPU) on tiny random checkpoints,
whatever the chunk budget, prefix-cache hits, preemption or batch composition (docs/architecture.md section 8)."""
import random

import pytest
import torch

from minillm import LLM, SamplingParams
from tiny_models import make_tiny_checkpoint

MAX_LEN = 96


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), arch="qwen3", vocab=256, seed=1)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q2"), arch="qwen2", vocab=256, tie=False, seed=2)


@pytest.fixture(scope="module")
def hf_cache():
    return {}


def hf_greedy(path, prompt, n, cache) -> list[int]:
    """Reference: full-sequence HF forward each step (no KV cache involved), argmax."""
    from transformers import AutoModelForCausalLM
    key = (str(path), tuple(prompt), n)
    if key not in cache:
        model = cache.setdefault(str(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        cache[key] = ids[len(prompt):]
    return cache[key]


def prompts_mixed(seed=0, count=6, vocab=256):
    rng = random.Random(seed)
    lens = [1, 5, 16, 17, 33, 40][:count]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(path, prompts, max_tokens=12, **kw):
    kw.setdefault("check_integrity", True)
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_LEN, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    assert not llm.has_unfinished_requests()
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_greedy_equals_hf(arch, qwen3_dir, qwen2_dir, hf_cache):
    path = qwen3_dir if arch == "qwen3" else qwen2_dir
    prompts = prompts_mixed()
    _, got = run(path, prompts)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(path, p, 12, hf_cache)


@pytest.mark.parametrize("budget", [4, 16, 64])
def test_chunked_prefill_equals_hf(budget, qwen3_dir, hf_cache):
    prompts = prompts_mixed(seed=3)
    _, got = run(qwen3_dir, prompts, max_num_batched_tokens=budget)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(qwen3_dir, p, 12, hf_cache)


def test_prefill_first_equals_hf(qwen3_dir, hf_cache):
    prompts = prompts_mixed(seed=4)
    _, got = run(qwen3_dir, prompts, enable_chunked_prefill=False, max_num_batched_tokens=64)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(qwen3_dir, p, 12, hf_cache)


def test_prefix_hits_equal_hf(qwen3_dir, hf_cache):
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(k)] for k in (0, 3, 9)] + [shared[:32]]
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    first = llm.generate([prompts[0]], sp, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], sp, use_tqdm=False)
    assert first.token_ids == hf_greedy(qwen3_dir, prompts[0], 8, hf_cache)
    for p, o in zip(prompts[1:], rest):
        assert o.token_ids == hf_greedy(qwen3_dir, p, 8, hf_cache)
    # the shared 32 tokens (two full blocks of 16) must have come from the cache the second time
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [32, 32, 16]   # a full-prompt hit recomputes its last block


def test_full_prompt_hit_still_samples(qwen3_dir, hf_cache):
    prompt = prompts_mixed(seed=6)[3] + [7] * 15   # 32 tokens: exactly two blocks
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True)
    sp = SamplingParams(max_tokens=5, **GREEDY)
    a = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    b = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    assert a == b == hf_greedy(qwen3_dir, prompt, 5, hf_cache)


def test_preemption_equals_hf(qwen3_dir, hf_cache):
    prompts = prompts_mixed(seed=7)
    # 14 blocks of 16 tokens cannot hold six sequences of up to 40 + 24 tokens at once: forces preemption.
    llm, got = run(qwen3_dir, prompts, max_tokens=24, num_kv_blocks=14, max_num_batched_tokens=32)
    assert llm.num_preemptions > 0
    for p, g in zip(prompts, got):
        assert g == hf_greedy(qwen3_dir, p, 24, hf_cache)


def test_prompt_at_max_model_len_minus_one(qwen3_dir, hf_cache):
    rng = random.Random(8)
    prompt = [rng.randrange(256) for _ in range(MAX_LEN - 1)]
    _, got = run(qwen3_dir, [prompt], max_tokens=1, max_num_batched_tokens=16)
    assert got[0] == hf_greedy(qwen3_dir, prompt, 1, hf_cache)


def test_batch_composition_invariance(qwen3_dir):
    prompts = prompts_mixed(seed=9)
    _, together = run(qwen3_dir, prompts)
    alone = [run(qwen3_dir, [p])[1][0] for p in prompts[:3]]
    assert together[:3] == alone


def test_seeded_sampling_reproducible_across_batches(qwen3_dir):
    prompts = prompts_mixed(seed=10)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN)
    batch = llm.generate(prompts, sp, use_tqdm=False)
    alone = llm.generate([prompts[2]], sp, use_tqdm=False)[0]
    assert batch[2].token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in batch}) > 1


def test_n_completions_share_prompt(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True)
    out = llm.generate([prompts_mixed()[4]], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6,
                                                            ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert len(llm.engine.outputs) == 0 and not llm.engine.runner.states.by_id   # nothing left behind


def test_n_siblings_hit_the_prompt_blocks(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True)
    children, admit = [], llm.engine.core.add_request
    llm.engine.core.add_request = lambda req: (children.append(req), admit(req))   # the core's Requests
    llm.add_request(prompts_mixed()[4], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True))
    while llm.has_unfinished_requests():
        llm.step()
    assert [c.num_cached_tokens for c in children] == [0, 32, 32]


def test_abort_n_before_siblings_start(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True)
    rid = llm.add_request(prompts_mixed()[4], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    assert llm.abort(rid)
    outs = [o for _ in range(3) for o in llm.step()]
    assert [o.finish_reason for o in outs] == ["abort"] * 3 and outs[-1].output is not None
    assert not llm.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()


def test_abort_running_and_waiting(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=1,
              check_integrity=True)
    sp = SamplingParams(max_tokens=30, **GREEDY)
    a = llm.add_request(prompts_mixed()[2], sp)
    b = llm.add_request(prompts_mixed()[3], sp)
    finals = {}
    for _ in range(3):
        for o in llm.step():
            assert o.request_id == a
    assert llm.abort(a) and llm.abort(b)
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                finals[o.request_id] = o.finish_reason
    assert finals == {a: "abort", b: "abort"}
    llm.engine.scheduler.check_integrity()


def test_bad_requests_leave_no_state(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    with pytest.raises(ValueError, match="vocabulary"):
        llm.add_request([1, 999])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request([1] * 90, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.add_request("text needs a tokenizer")
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([[1, 2], []], use_tqdm=False)
    assert not llm.has_unfinished_requests()
