"""The start-up warm-up of the eager step path: which token counts it runs, and that it leaves the cache alone."""
import torch

from minillm import LLM
from minillm.runner.warmup import logits_rows, token_counts, warm_up_shapes


def test_token_counts_cover_small_counts_and_the_maximum():
    counts = token_counts(16384)
    assert counts[:16] == list(range(1, 17)) and counts[-1] == 16384
    assert 1008 in counts and 1152 in counts and 5120 in counts and 1040 not in counts
    assert all(b > a for a, b in zip(counts, counts[1:]))
    assert token_counts(100) == list(range(1, 17)) + list(range(32, 97, 16)) + [100]
    assert logits_rows(20) == list(range(1, 17)) + [20] and logits_rows(3) == [1, 2, 3]


def test_warm_up_writes_nothing_to_the_kv_cache(tiny_model):
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", max_model_len=96, max_num_batched_tokens=128,
              max_num_seqs=8)
    runner = llm.engine.runner
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    calls = []
    warm = runner.sampler.warm_up
    runner.sampler.warm_up = lambda logits: (calls.append(logits.shape), warm(logits))
    assert warm_up_shapes(runner) > 0
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    # the sampler's kernels are warmed on the widest logits, and its non-finite watch still checks the first step
    assert calls == [(8, runner.vocab_size)]
    assert not runner.sampler.nonfinite.seen and runner.sampler.nonfinite._calls == 0
