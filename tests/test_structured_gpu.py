"""Structured outputs on a GPU: the bitmask op on the device equals the CPU op, and constrained generation with
async scheduling (masks built while the next step's forward runs), CUDA graphs and the CUDA sampler gives the
tokens of synchronous steps, every output inside its grammar."""
import dataclasses
import re

import pytest
import torch

from minillm.llm import LLM
from minillm.sampling.grammar_mask import GrammarMask, apply_grammar_mask
from minillm.sampling_params import SamplingParams
from minillm.structured.spec import from_structured_outputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("rows,v,words", [(None, 151936, None), ([1, 5, 6], 151936, None), ([7, 0], 1000, 40),
                                          (None, 33, None)])
def test_mask_op_on_the_device_equals_the_cpu_op(rows, v, words, kernel):
    """The torch path on the device and the kernel (cuda/grammar_mask.cu) both equal the CPU reference, also with
    a vocabulary that is not a multiple of 32 and a bitmask wider than it (its extra bits never reach logits)."""
    if kernel:
        from minillm.ops.build import load_extension
        load_extension()
    g = torch.Generator().manual_seed(0)
    n = 8
    logits = torch.randn(n, v, generator=g)
    m = n if rows is None else len(rows)
    words = words or (v + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (m, words), dtype=torch.int32, generator=g)
    idx = None if rows is None else torch.tensor(rows)
    cpu = logits.clone()
    apply_grammar_mask(cpu, GrammarMask(bitmask, idx))
    assert torch.isinf(cpu).any() and torch.isfinite(cpu).any()
    dev = logits.cuda()
    apply_grammar_mask(dev, GrammarMask(bitmask.cuda(), None if idx is None else idx.cuda()), cuda=kernel)
    assert torch.equal(dev.cpu(), cpu)


def test_mask_kernel_refuses_a_bitmask_narrower_than_the_vocabulary():
    from minillm.ops.build import load_extension
    load_extension()
    logits = torch.zeros(2, 100, device="cuda")
    with pytest.raises(ValueError, match="words a row"):
        torch.ops.minillm.grammar_mask_(logits, torch.zeros(2, 3, dtype=torch.int32, device="cuda"), None)


def test_constrained_async_equals_sync_on_the_gpu():
    llm = LLM(device="cuda", max_num_seqs=16)
    pattern = "[a-z]{5,20}-[0-9]{2,4}"
    spec = from_structured_outputs({"regex": pattern})
    prompts = [f"item {i}:" for i in range(12)]
    params = [SamplingParams(temperature=t, max_tokens=48, seed=i, structured=spec if i % 3 else None)
              for i, t in zip(range(12), [1.0, 0.0, 0.7] * 4)]
    first = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    cfg = core.cfg
    core.cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, async_scheduling=False))
    try:
        second = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.cfg = cfg
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    for i, o in enumerate(first):
        if i % 3 and o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    assert sum(bool(i % 3) and o.outputs[0].finish_reason == "stop" for i, o in enumerate(first)) >= 6
