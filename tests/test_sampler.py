"""Sampler tests on CPU: greedy, seeds, top-k/top-p/min-p masks vs sort-based references, penalties,
min_tokens, the exponential race's distribution, logprobs, and half-precision logits (same tokens as fp32)."""
import itertools
import math

import numpy as np

import pytest
import torch

from minillm.request import Request
from minillm.sampling.batch import SamplingBatch, SamplingBatchCache
from minillm.sampling.penalties import apply_penalties
from minillm.sampling.sampler import Sampler, truncate_logits
from minillm.sampling_params import SamplingParams

V = 64
_ids = itertools.count()


def req(prompt=(1, 2, 3), output=(), eos=frozenset({V - 1}), **params) -> Request:
    r = Request(f"r{next(_ids)}", list(prompt), SamplingParams(max_tokens=64, **params), eos_token_ids=eos)
    for t in output:
        r.append_output_token(t)
    return r


def rand_logits(n, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def sample(requests, logits, seed=0):
    batch = SamplingBatch.build(requests, "cpu", logits.shape[1])
    return Sampler(seed)(logits.clone(), batch)


def test_all_greedy_batch_is_plain_argmax_and_builds_nothing_else(monkeypatch):
    """The batch holds no per-row tensors. The torch path (cuda=False) takes the argmax; with the CUDA kernels
    chosen, the one-pass op does, once, with inverse temperature 0 on every row (here on the CPU, where the op
    runs its numpy reference; the kernel against torch.argmax is checked in tests/test_fused_gpu.py), and the
    step count that keys sampled rows' noise does not move."""
    from minillm.ops import sampling_ops

    logits = rand_logits(5)
    logits[1, [3, 40]] = 99.0                     # a tie: the lowest column, as torch.argmax
    batch = SamplingBatch.build([req(temperature=0.0, top_k=5, top_p=0.5) for _ in range(5)], "cpu", V)
    assert batch.all_greedy
    assert (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.penalties) == (None,) * 5
    out = Sampler()(logits.clone(), batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.token_ids.dtype == torch.int64

    calls, op = [], sampling_ops.sample_exponential_race
    monkeypatch.setattr(sampling_ops, "sample_exponential_race",
                        lambda lg, inv_t, *a, **kw: calls.append(inv_t.clone()) or op(lg, inv_t, *a, **kw))
    sampler = Sampler(cuda=True)
    out = sampler(logits.clone(), batch)
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.token_ids[1].item() == 3
    assert out.logprobs is None and out.token_ids.dtype == torch.int64
    assert len(calls) == 1 and torch.equal(calls[0], torch.zeros(5))
    assert sampler._fused_steps == 0


def test_greedy_rows_exact_in_mixed_batch():
    logits = rand_logits(6)
    requests = [req(temperature=0.0 if i % 2 == 0 else 1.5, top_k=3 if i % 2 else 0) for i in range(6)]
    for seed in range(5):
        tokens = sample(requests, logits, seed).token_ids
        assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_tiny_temperature_is_greedy_and_empty_batch_is_fine():
    logits = rand_logits(3)
    tokens = sample([req(temperature=1e-7), req(temperature=0.0), req(temperature=1e-6)], logits).token_ids
    assert torch.equal(tokens, logits.argmax(-1))
    assert sample([], torch.zeros(0, V)).token_ids.shape == (0,)


def test_seeded_request_reproducible_across_batch_composition_and_order():
    row = rand_logits(1, seed=7)[0] * 0.2  # flat distribution: the noise decides
    alone, batched = [], []
    for k in range(20):
        mine = req(temperature=1.0, seed=1234, output=[5] * k)
        alone.append(sample([mine], row[None]).token_ids.item())
        others = [req(temperature=0.8, top_p=0.9), req(temperature=0.0), req(temperature=1.0, seed=99, top_k=7)]
        requests = others[:k % 4] + [mine] + others[k % 4:]
        logits = rand_logits(4, seed=k)
        logits[k % 4] = row
        batched.append(sample(requests, logits, seed=k).token_ids[k % 4].item())
    assert alone == batched
    assert len(set(alone)) > 5  # the noise really changes with the token index k


def test_unseeded_rows_reproducible_run_to_run():
    requests = [req(temperature=1.0) for _ in range(4)]
    logits = rand_logits(4) * 0.1
    assert torch.equal(sample(requests, logits, seed=3).token_ids, sample(requests, logits, seed=3).token_ids)


def test_seeded_rows_are_one_batch_of_philox_words_keyed_by_seed_and_output_index():
    """The batch lists each seeded sampling row once as (row, seed as 64 bits, output index): greedy and unseeded
    rows are not listed. Their words are Philox4x32-10 with the row's own key (the per-row key of the reference
    equals the scalar-key Philox), so the row index plays no part."""
    from minillm.ops.sampling_ops import SEEDED_TAG, philox4x32_10, seeded_uniform_ref, unit_from_words

    requests = [req(temperature=1.0, seed=-5, output=[4] * 3), req(temperature=0.0, seed=7), req(temperature=0.7),
                req(temperature=1.2, seed=2**64 + 3, output=[1])]
    seeded = SamplingBatch.build(requests, "cpu", V).seeded
    assert seeded.args.tolist() == [[0, 3], [-5, 3], [3, 1]]   # seed mod 2**64, shown as int64 bits
    u = seeded_uniform_ref(seeded.args, V)
    for j, (seed, pos) in enumerate([((-5) % 2**64, 3), (3, 1)]):
        counter = np.array([[g, pos, 0, SEEDED_TAG] for g in range(V // 4)], dtype=np.uint32)
        words = philox4x32_10(counter, (seed & 0xFFFFFFFF, seed >> 32)).reshape(-1)
        assert np.array_equal(u[j], unit_from_words(words))
    assert (u > 0).all() and (u <= 1).all()
    assert not np.array_equal(u[0], seeded_uniform_ref(np.array([[0], [-5], [4]]), V)[0])   # next token: new noise


def kept_by_truncation(requests, logits):
    batch = SamplingBatch.build(requests, "cpu", logits.shape[1])
    masked = logits.clone()
    if batch.temperature is not None:
        masked.div_(batch.temperature)
    truncate_logits(masked, batch)
    return torch.isfinite(masked)


def test_top_k_mask_exact_vs_sort_reference():
    logits = rand_logits(5)
    ks = [1, 3, 10, 0, V + 5]
    kept = kept_by_truncation([req(top_k=k) for k in ks], logits)
    for i, k in enumerate(ks):
        k_eff = k if 0 < k < V else V
        expected = torch.zeros(V, dtype=torch.bool)
        expected[logits[i].sort(descending=True).indices[:k_eff]] = True
        assert torch.equal(kept[i], expected), f"row {i} top_k={k}"


def ref_top_p_count(probs_row, p):
    """Sort-based reference: keep tokens whose preceding mass is < p (the crossing token is kept)."""
    s = probs_row.double().sort(descending=True).values
    return int(((s.cumsum(0) - s) < p).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_kept_count_within_one_of_reference(temperature):
    logits = rand_logits(8, seed=3)
    ps = [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0]
    kept = kept_by_truncation([req(top_p=p, temperature=temperature) for p in ps], logits)
    for i, p in enumerate(ps):
        ref = ref_top_p_count((logits[i] / temperature).softmax(-1), p)
        assert abs(int(kept[i].sum()) - ref) <= 1, f"top_p={p}"
        # Kept tokens are always the most likely ones.
        assert kept[i][logits[i].topk(int(kept[i].sum())).indices].all()


def test_top_k_then_top_p_renormalised():
    logits = rand_logits(3, seed=5)
    kept = kept_by_truncation([req(top_k=6, top_p=0.6), req(top_k=2, top_p=0.99), req(top_k=0, top_p=0.6)],
                              logits)
    for i, (k, p) in enumerate([(6, 0.6), (2, 0.99), (V, 0.6)]):
        top = logits[i].topk(k).values.softmax(-1)  # top-k first, renormalised, then top-p
        assert abs(int(kept[i].sum()) - ref_top_p_count(top, p)) <= 1
        assert int(kept[i].sum()) <= k


def test_min_p_mask_vs_reference():
    logits = rand_logits(4, seed=9)
    mps = [0.0, 0.05, 0.3, 1.0]
    kept = kept_by_truncation([req(min_p=m) for m in mps], logits)
    for i, m in enumerate(mps):
        probs = logits[i].softmax(-1)
        assert torch.equal(kept[i], probs >= m * probs.max() * (1 - 1e-6))


def test_sampled_tokens_respect_top_k():
    logits = rand_logits(64, seed=2) * 0.1
    tokens = sample([req(top_k=3, temperature=2.0) for _ in range(64)], logits).token_ids
    allowed = logits.topk(3, dim=-1).indices
    assert (allowed == tokens[:, None]).any(-1).all()


def test_penalties_match_reference_formulas():
    prompt, output = [1, 2, 2, 7], [2, 3, 3, 3, 9]
    params = [dict(presence_penalty=0.5), dict(frequency_penalty=0.3), dict(repetition_penalty=1.7),
              dict(presence_penalty=-0.4, frequency_penalty=0.2, repetition_penalty=0.8), dict()]
    requests = [req(prompt=prompt, output=output, **p) for p in params]
    logits = rand_logits(len(params), seed=4)
    batch = SamplingBatch.build(requests, "cpu", V)
    got = logits.clone()
    apply_penalties(got, batch.penalties)
    for i, p in enumerate(params):
        expected = logits[i].clone()
        rep = p.get("repetition_penalty", 1.0)
        for t in set(prompt + output):
            expected[t] = expected[t] / rep if expected[t] > 0 else expected[t] * rep
        for t in set(output):
            expected[t] -= p.get("frequency_penalty", 0.0) * output.count(t) + p.get("presence_penalty", 0.0)
        torch.testing.assert_close(got[i], expected, msg=f"row {i}: {p}")


def test_penalty_token_history_follows_appended_tokens():
    r = req(prompt=[1], output=[2], frequency_penalty=1.0, repetition_penalty=2.0)
    logits = torch.full((1, V), 4.0)
    for step in range(3):
        batch = SamplingBatch.build([r], "cpu", V)
        got = logits.clone()
        apply_penalties(got, batch.penalties)
        seen = set(r.all_token_ids)
        expected = [(2.0 if t in seen else 4.0) - r.output_token_ids.count(t) for t in range(V)]
        assert got[0].tolist() == expected, f"step {step}"
        r.append_output_token(2 if step == 0 else 30 + step)


def test_no_penalty_tensors_without_penalties():
    batch = SamplingBatch.build([req(temperature=0.5, top_p=0.9)], "cpu", V)
    assert batch.penalties is None and batch.top_k is None and batch.top_p is not None


def batch_fields(batch: SamplingBatch) -> dict:
    def plain(x):
        if isinstance(x, (torch.Tensor, np.ndarray)):
            return (x.dtype, x.tolist())
        return {k: plain(v) for k, v in vars(x).items()} if hasattr(x, "__dataclass_fields__") else x
    return {k: plain(v) for k, v in vars(batch).items()}


def test_sampling_batch_cache_reuses_a_batch_only_while_a_fresh_build_would_equal_it():
    cache = SamplingBatchCache("cpu", V)
    static = [req(temperature=0.7, top_k=5), req(temperature=0.0), req(top_p=0.9, min_p=0.1, logprobs=2),
              req(min_tokens=1, output=[4])]           # a lifted min_tokens ban never comes back
    first = cache.get(static)
    for t in (4, 5):
        for r in static:
            r.append_output_token(t)
        assert cache.get(list(static)) is first       # the same requests: the very batch
        assert batch_fields(first) == batch_fields(SamplingBatch.build(static, "cpu", V))
    for other in (static[1:], [req(temperature=0.0)] + static[1:], static[::-1]):
        assert batch_fields(cache.get(other)) == batch_fields(SamplingBatch.build(other, "cpu", V))
    # A row that reads its own history or output count changes the batch every step: rebuilt each time.
    for kw in (dict(presence_penalty=0.5), dict(repetition_penalty=1.2), dict(min_tokens=3)):
        reqs = [req(**kw), req()]
        before = cache.get(reqs)
        reqs[0].append_output_token(5)
        after = cache.get(reqs)
        assert after is not before and batch_fields(after) == batch_fields(SamplingBatch.build(reqs, "cpu", V))


def seeded_positions(batch: SamplingBatch) -> list[int]:
    return (batch.seeded.args[2] + batch.seeded.offset).tolist()


def test_sampling_batch_cache_reuses_seeded_rows_only_while_every_output_index_moved_alike():
    """Seeded rows' output indices move with the step: a reused batch carries the move as an offset, and draws
    the noise a fresh build would; rows that moved by different counts (or backwards) get a fresh build."""
    cache = SamplingBatchCache("cpu", V)
    reqs = [req(seed=3, temperature=0.5), req(), req(seed=-1, output=[7, 7])]
    first = cache.get(reqs)
    for step in range(1, 4):
        for r in reqs:
            r.append_output_token(5)
        assert cache.get(reqs) is first and first.seeded.offset == step
        fresh = SamplingBatch.build(reqs, "cpu", V)
        assert seeded_positions(first) == seeded_positions(fresh) == [step, 2 + step]
        logits = rand_logits(3, seed=step) * 0.1
        assert torch.equal(Sampler(1)(logits.clone(), first).token_ids, Sampler(1)(logits.clone(), fresh).token_ids)
    reqs[0].append_output_token(5)                     # row 0 moved, row 2 did not
    moved = cache.get(reqs)
    assert moved is not first and moved.seeded.offset == 0 and seeded_positions(moved) == [4, 5]
    # seq_lens (async scheduling: the tokens in flight count) decide the output index when given.
    assert seeded_positions(cache.get(reqs, [3 + 6, 4, 3 + 7])) == [6, 7]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(4, V)
    logits[:, V - 1] = 50.0  # EOS dominates
    logits[:, 10] = 40.0     # a stop token id comes next
    requests = [req(temperature=0.0, min_tokens=2, stop_token_ids=[10]),
                req(temperature=1.0, min_tokens=2, output=[4]),
                req(temperature=0.0, min_tokens=2, output=[4, 4]),
                req(temperature=0.0, min_tokens=2, ignore_eos=True)]
    tokens = sample(requests, logits).token_ids.tolist()
    assert tokens[0] not in (V - 1, 10)
    assert tokens[1] == 10               # EOS masked, stop id not listed for this row
    assert tokens[2] == V - 1            # min_tokens reached: EOS allowed again
    assert tokens[3] == V - 1            # ignore_eos: EOS is not a stop, nothing to mask


def chi_square(counts, probs):
    n = counts.sum()
    return float(((counts - n * probs) ** 2 / (n * probs)).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_exponential_race_matches_softmax(temperature):
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 8000
    tokens = sample([req(temperature=temperature) for _ in range(n)], base.repeat(n, 1), seed=11).token_ids
    counts = torch.bincount(tokens, minlength=5).double()
    # 4 degrees of freedom: chi2 > 30 has p < 1e-5.
    assert chi_square(counts, (base / temperature).softmax(-1).double()) < 30


def test_seeded_rows_distribution_matches_softmax():
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2])
    n = 3000
    tokens = sample([req(seed=s) for s in range(n)], base.repeat(n, 1)).token_ids
    assert chi_square(torch.bincount(tokens, minlength=5).double(), base.softmax(-1).double()) < 30


def test_logprobs_top_n_and_sampled_token():
    logits = rand_logits(4, seed=6)
    requests = [req(temperature=0.5, logprobs=3), req(temperature=1.0), req(temperature=0.0, logprobs=0),
                req(temperature=0.0, logprobs=5, top_k=2)]
    out = sample(requests, logits)
    assert out.logprobs[1] is None
    temps = [0.5, 1.0, 1.0, 1.0]
    for i, n in [(0, 3), (2, 0), (3, 5)]:
        lp = (logits[i] / temps[i]).log_softmax(-1)
        entry = out.logprobs[i]
        assert entry.token_id == out.token_ids[i].item()
        assert math.isclose(entry.logprob, lp[entry.token_id].item(), rel_tol=1e-5, abs_tol=1e-6)
        top = lp.topk(n) if n else None
        assert list(entry.top) == ([] if top is None else top.indices.tolist())
        if top is not None:
            assert all(math.isclose(entry.top[t], v, rel_tol=1e-5, abs_tol=1e-6)
                       for t, v in zip(top.indices.tolist(), top.values.tolist()))


def test_all_greedy_logprobs():
    logits = rand_logits(2)
    out = sample([req(temperature=0.0, logprobs=2), req(temperature=0.0)], logits)
    assert out.logprobs[1] is None
    assert out.logprobs[0].token_id == logits[0].argmax().item()
    assert math.isclose(out.logprobs[0].logprob, logits[0].log_softmax(-1).max().item(), rel_tol=1e-5)


def test_bad_inputs_rejected():
    batch = SamplingBatch.build([req()], "cpu", V)
    with pytest.raises(ValueError, match="logits must have shape"):
        Sampler()(torch.zeros(2, V), batch)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        Sampler()(torch.zeros(1, V, dtype=torch.float64), batch)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingBatch.build([req()], "cpu", 0)
    with pytest.raises(ValueError, match="seed"):
        Sampler(seed="x")


def _mixed_requests():
    """Every path of the sampler: greedy, plain temperature, top-k/top-p/min-p, seeds, penalties, min_tokens,
    logprobs."""
    return [req(temperature=0.0), req(temperature=0.7), req(temperature=1.3, top_k=5), req(top_p=0.8),
            req(min_p=0.1, temperature=0.9), req(seed=7, temperature=1.1), req(temperature=0.8, logprobs=2),
            req(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.2, output=[3, 3, 5]),
            req(temperature=0.6, min_tokens=4, output=[1]), req(temperature=0.0, presence_penalty=0.5, output=[9])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_give_the_fp32_tokens(dtype):
    """The runner hands the sampler the lm_head's own dtype; widening to fp32 is exact, so every path (here
    the torch path: CPU) picks exactly the tokens of the same values in fp32, and never writes the input."""
    requests = _mixed_requests()
    for seed in range(4):
        half = rand_logits(len(requests), seed=seed).to(dtype)
        kept = half.clone()
        for batch_reqs in (requests, requests[1:2] * 3, requests[:1] * 3, requests[6:7]):
            n = len(batch_reqs)
            got = Sampler(seed)(half[:n], SamplingBatch.build(batch_reqs, "cpu", V))
            ref = sample(batch_reqs, half[:n].float(), seed)
            assert torch.equal(got.token_ids, ref.token_ids)
            assert got.logprobs == ref.logprobs
        assert torch.equal(half, kept)


def test_fused_path_gets_half_precision_logits_only_when_nothing_modifies_them(monkeypatch):
    """With the CUDA kernels chosen (Sampler(cuda=True)), plain temperature sampling and all-greedy batches hand
    the one-pass kernel the half-precision logits as they are, unless penalties or the min_tokens ban must first
    change them (then fp32 logits); logprobs never reach it. Which dtype the op receives is
    checked here on the CPU (where the op runs its numpy reference); the kernel's tokens against the torch path
    are checked on a GPU in tests/test_fused_gpu.py. Truncated batches without seeds reach it too, as fp32 (their
    logits are divided by T first); seeded ones do not."""
    from minillm.ops import sampling_ops

    seen, op = [], sampling_ops.sample_exponential_race

    def recording(logits, *args, **kw):
        seen.append(logits.dtype)
        return op(logits, *args, **kw)

    monkeypatch.setattr(sampling_ops, "sample_exponential_race", recording)
    plain = [req(temperature=0.0), req(temperature=0.7), req(temperature=1.5)]
    penalised = plain[:2] + [req(temperature=1.0, repetition_penalty=1.5, output=[2, 2])]
    banned = plain[:2] + [req(temperature=0.9, min_tokens=3)]
    greedy = [req(temperature=0.0), req(temperature=0.0)]
    for requests, kernel_dtype in ((plain, [torch.bfloat16]), (penalised, [torch.float32]), (banned, [torch.float32]),
                                   # truncation: the threshold kernel, then the race on fp32 logits / T
                                   (plain[:1] + [req(temperature=0.7, top_k=3)], [torch.float32]),
                                   (plain[:1] + [req(temperature=0.7, top_p=0.8, seed=3)], []),
                                   (plain[:1] + [req(temperature=0.7, logprobs=1)], []),
                                   # all greedy: the kernel too (an argmax), unless logprobs are asked for
                                   (greedy, [torch.bfloat16]),
                                   (greedy[:1] + [req(temperature=0.0, presence_penalty=0.5, output=[2])],
                                    [torch.float32]),
                                   (greedy[:1] + [req(temperature=0.0, logprobs=1)], [])):
        seen.clear()
        Sampler(3, cuda=True)(rand_logits(len(requests), seed=5).bfloat16(), SamplingBatch.build(requests, "cpu", V))
        assert seen == kernel_dtype
        seen.clear()
        Sampler(3, cuda=False)(rand_logits(len(requests), seed=5).bfloat16(), SamplingBatch.build(requests, "cpu", V))
        assert seen == []       # the torch path never calls the op




def test_truncation_threshold_op_on_cpu_is_the_torch_path():
    """cuda=True asks for the threshold kernel, which only runs on CUDA tensors: on the CPU the op is its torch
    path, and the sampler with the kernels chosen picks the very tokens it picks without them (the kernel against
    this path is tests/test_sampling_topp_gpu.py)."""
    from minillm.ops.sampling_ops import truncation_threshold, truncation_threshold_torch

    requests = [req(top_p=0.9, temperature=0.7), req(top_k=5, top_p=0.5), req(top_k=3), req(min_p=0.2),
                req(temperature=0.0), req(top_p=0.3, seed=4)]
    logits = rand_logits(len(requests), seed=8)
    batch = SamplingBatch.build(requests, "cpu", V)
    args = (logits, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k)
    assert torch.equal(truncation_threshold(*args, cuda=True), truncation_threshold_torch(*args[:4], args[4]))
    assert truncation_threshold(logits, None, None, None, cuda=True) is None
    for seed in range(3):
        got = Sampler(seed, cuda=True)(logits.clone(), batch).token_ids
        assert torch.equal(got, Sampler(seed, cuda=False)(logits.clone(), batch).token_ids)


def test_truncation_threshold_torch_keeps_ties_and_at_least_one():
    """The reference's edge rules the kernel must share: every tie of the last kept value stays; top-p keeps at
    least one token however small p; k = V or p = 1 keeps everything (threshold -inf)."""
    from minillm.ops.sampling_ops import truncation_threshold_torch

    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -math.inf], [5.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    k = torch.tensor([2, 6, 6, 6])
    p = torch.tensor([1.0, 1e-6, 0.5, 1.0])
    thr = truncation_threshold_torch(logits, k, p, None, 2)
    kept = (logits >= thr).sum(dim=1).tolist()
    assert kept == [4, 1, 6, 6]
    assert float(thr[3]) == -math.inf


def test_threshold_vocab_limit_matches_the_kernel():
    """The op hands the kernel only vocabularies its fixed-point sums cover (cuda/fused.h), else its torch path."""
    import re
    from pathlib import Path

    from minillm.ops.sampling_ops import THRESHOLD_MAX_VOCAB

    header = (Path(__file__).resolve().parents[1] / "cuda" / "fused.h").read_text()
    assert int(re.search(r"constexpr int64_t kMaxThresholdVocab = (\d+);", header).group(1)) == THRESHOLD_MAX_VOCAB


def test_fused_truncated_path_draws_from_the_masked_softmax():
    """Sampler(cuda=True) without seeds or logprobs: logits / T, the threshold, then the one-pass race that skips
    what the threshold masks (here the op's numpy reference: CPU). Every token is in its row's kept set, each row's
    token is the reference race's on the divided logits, and the draws follow the truncated softmax."""
    from minillm.ops.sampling_ops import sample_exponential_race_ref, truncation_threshold_torch

    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n, t, p = 6000, 0.8, 0.75   # top-6 mass before the 3rd token: 0.731, before the 4th: 0.867
    requests = [req(temperature=t, top_p=p, top_k=6) for _ in range(n)] + [req(temperature=0.0)]
    logits = torch.cat([base.repeat(n, 1), base[None]])
    batch = SamplingBatch.build(requests, "cpu", 8)
    tokens = Sampler(9, cuda=True)(logits.clone(), batch).token_ids
    scaled = logits / batch.temperature
    thr = truncation_threshold_torch(scaled, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k)
    ref = sample_exponential_race_ref(scaled, batch.unit_inverse_temperature("cpu"), 9, 1, thr.squeeze(1))
    assert torch.equal(tokens, ref)
    assert int(tokens[-1]) == 0                                       # the greedy row
    kept = scaled[0] >= thr[0]
    assert kept.tolist() == [True, True, True, False, False, False, False, False]
    probs = (base / t).softmax(-1).double() * kept
    counts = torch.bincount(tokens[:n], minlength=8).double()
    assert counts[~kept].sum() == 0
    # 2 degrees of freedom: chi2 > 25 has p < 1e-5.
    assert chi_square(counts[kept], probs[kept] / probs.sum()) < 25


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)]: a random third of the tokens allowed per row (xgrammar's layout)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=g) < 1 / 3
    bits = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def test_race_reads_a_grammar_bitmask_as_masking_a_copy_first(monkeypatch):
    """The one-pass op's bitmask (the rows it lists, or every row) gives the tokens of the same op on a copy of
    the logits masked by the grammar mask's torch path; the sampler hands it the half-precision logits as they
    are, with the mask, when nothing else changes them (on the CPU the op runs its numpy reference; the kernel
    against it is checked in tests/test_fused_gpu.py)."""
    from minillm.ops import sampling_ops
    from minillm.sampling.grammar_mask import GrammarMask, allowed_tokens, apply_grammar_mask

    vocab, n = 1001, 6
    logits = rand_logits(n, vocab, seed=3).to(torch.bfloat16)
    inv_t = torch.tensor([0.0, 1.0, 0.5, 2.0, 0.0, 1.0])
    for rows in (None, torch.tensor([1, 2, 4])):
        bitmask = _random_bitmask(n if rows is None else len(rows), vocab, seed=7)
        masked = logits.float()
        apply_grammar_mask(masked, GrammarMask(bitmask, rows))
        out = sampling_ops.sample_exponential_race(logits, inv_t, 5, 9, None, bitmask, rows)
        assert torch.equal(out, sampling_ops.sample_exponential_race(masked, inv_t, 5, 9))
        listed = torch.arange(n) if rows is None else rows
        assert allowed_tokens(bitmask, vocab)[torch.arange(len(listed)), out[listed]].all()
    with pytest.raises(ValueError, match="not both"):
        sampling_ops.sample_exponential_race(logits, inv_t, 5, 9, torch.zeros(n), bitmask, rows)

    seen, op = [], sampling_ops.sample_exponential_race
    monkeypatch.setattr(sampling_ops, "sample_exponential_race",
                        lambda lg, *a, **kw: seen.append((lg.dtype, kw.get("bitmask") is not None)) or op(lg, *a, **kw))
    batch = SamplingBatch.build([req(temperature=0.0), req(temperature=0.8), req(temperature=1.3)], "cpu", vocab)
    grammar = GrammarMask(_random_bitmask(2, vocab, seed=8), torch.tensor([0, 2]))
    tokens = Sampler(4, cuda=True)(logits[:3].clone(), batch, grammar).token_ids
    assert seen == [(torch.bfloat16, True)]
    assert allowed_tokens(grammar.bitmask, vocab)[torch.arange(2), tokens[[0, 2]]].all()
