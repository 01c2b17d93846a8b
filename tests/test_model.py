"""QwenForCausalLM (Qwen3 and Qwen2) against HF transformers on tiny random checkpoints, CPU, fp32.

The model runs through the paged KV cache exactly as in the engine: a small driver below plays the runner
(block tables, metadata, one forward per step, decode rows first).
"""
import random

import pytest
import torch

from minillm.model.loader import load_model
from tiny_models import (alloc_block_tables, build_metadata, flat_positions, hf_greedy, hf_logits,
                         make_tiny_checkpoint)

VARIANTS = [("qwen3", True), ("qwen3", False), ("qwen2", True), ("qwen2", False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {(a, tie): make_tiny_checkpoint(root / f"{a}_{tie}", a, tie=tie, seed=7) for a, tie in VARIANTS}


class PagedDriver:
    """A minimal runner: per-sequence block tables in a NaN-filled paged cache, one forward per step."""

    def __init__(self, model, arch, max_lens: list[int], block_size: int = 4):
        self.model, self.block_size = model, block_size
        self.tables, num_blocks = alloc_block_tables(max_lens, block_size, seed=1)
        shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                   for _ in range(arch.num_hidden_layers)]
        self.computed = [0] * len(max_lens)

    @torch.no_grad()
    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """work = [(seq index, new token ids)] in row order -> fp32 logits [len(ids), vocab] per entry."""
        seqs = [(self.computed[i], len(ids)) for i, ids in work]
        meta = build_metadata(seqs, self.block_size, [self.tables[i] for i, _ in work])
        input_ids = torch.tensor([t for _, ids in work for t in ids])
        logits = self.model.compute_logits(self.model(input_ids, flat_positions(seqs), self.kv, meta))
        for i, ids in work:
            self.computed[i] += len(ids)
        qsl = meta.query_start_loc_cpu
        return [logits[qsl[s]:qsl[s + 1]] for s in range(len(work))]


def _load(path, dtype="float32"):
    model, arch, _ = load_model(str(path), dtype=dtype, device="cpu")
    return model, arch


@pytest.mark.parametrize("arch,tie", VARIANTS)
def test_full_prompt_logits_match_hf(checkpoints, arch, tie):
    path = checkpoints[(arch, tie)]
    ids = random.Random(0).choices(range(256), k=21)
    model, cfg = _load(path)
    assert (model.lm_head is None) == tie
    logits = PagedDriver(model, cfg, [len(ids)]).step([(0, ids)])[0]
    assert logits.dtype == torch.float32
    assert (logits - hf_logits(path, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("arch,tie", [("qwen3", True), ("qwen2", False)])
def test_chunked_prefill_then_decode_reproduces_every_position(checkpoints, arch, tie):
    path = checkpoints[(arch, tie)]
    rng = random.Random(1)
    a, b = rng.choices(range(256), k=13), rng.choices(range(256), k=11)
    model, cfg = _load(path)
    drv = PagedDriver(model, cfg, [len(a), len(b)])
    got_a, got_b = [], []
    # Two prefill chunks each (crossing block boundaries), both sequences in the same steps.
    for (a_lo, a_hi), (b_lo, b_hi) in [((0, 5), (0, 3)), ((5, 9), (3, 8))]:
        la, lb = drv.step([(0, a[a_lo:a_hi]), (1, b[b_lo:b_hi])])
        got_a.append(la)
        got_b.append(lb)
    for pos in range(9, 13):   # then decode rows, one token per step
        work = [(0, [a[pos]])] + ([(1, [b[pos - 1]])] if pos - 1 < len(b) else [])
        out = drv.step(work)
        got_a.append(out[0])
        if len(out) > 1:
            got_b.append(out[1])
    assert (torch.cat(got_a) - hf_logits(path, a)).abs().max() < 1e-4
    assert (torch.cat(got_b) - hf_logits(path, b)).abs().max() < 1e-4


def _greedy_batch(model, cfg, prompts: list[list[int]], max_new: int, budget: int) -> list[list[int]]:
    """Continuous batching in miniature: each step runs every decode row, then prompt chunks within budget."""
    drv = PagedDriver(model, cfg, [len(p) + max_new for p in prompts])
    out = [[] for _ in prompts]
    while any(len(o) < max_new for o in out):
        work = [(i, [out[i][-1]]) for i, p in enumerate(prompts)
                if drv.computed[i] >= len(p) and 0 < len(out[i]) < max_new]
        left = budget - len(work)
        for i, p in enumerate(prompts):
            todo = len(p) - drv.computed[i]
            if todo > 0 and left > 0:
                take = min(todo, left)
                work.append((i, p[drv.computed[i]:drv.computed[i] + take]))
                left -= take
        for (i, ids), logits in zip(work, drv.step(work)):
            if drv.computed[i] >= len(prompts[i]):   # prompt done: the last row predicts the next token
                out[i].append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("arch,tie", [("qwen3", True), ("qwen2", False)])
def test_greedy_batch_equals_hf_generate(checkpoints, arch, tie):
    path = checkpoints[(arch, tie)]
    rng = random.Random(2)
    prompts = [rng.choices(range(256), k=n) for n in (1, 5, 11, 17)]
    model, cfg = _load(path)
    got = _greedy_batch(model, cfg, prompts, max_new=6, budget=8)
    assert got == [hf_greedy(path, p, 6) for p in prompts]


def test_bf16_model_tracks_fp32(checkpoints):
    path = checkpoints[("qwen3", True)]
    ids = random.Random(3).choices(range(256), k=9)
    model, cfg = _load(path, dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = PagedDriver(model, cfg, [len(ids)]).step([(0, ids)])[0]
    assert logits.dtype == torch.float32
    ref = hf_logits(path, ids)
    assert (logits - ref).abs().max() < 0.15 * ref.abs().max()


def test_rejects_kv_caches_of_wrong_length(checkpoints):
    model, cfg = _load(checkpoints[("qwen3", True)])
    meta = build_metadata([(0, 2)], 4, [[1]])
    with pytest.raises(ValueError, match="kv_caches has 1 entries"):
        model(torch.tensor([1, 2]), flat_positions([(0, 2)]), [None], meta)
