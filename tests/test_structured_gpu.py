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


@pytest.mark.parametrize("rows", [None, [1, 5, 6]])
def test_mask_op_on_the_device_equals_the_cpu_op(rows):
    g = torch.Generator().manual_seed(0)
    n, v = 8, 151936
    logits = torch.randn(n, v, generator=g)
    m = n if rows is None else len(rows)
    bitmask = torch.randint(-2**31, 2**31 - 1, (m, (v + 31) // 32), dtype=torch.int32, generator=g)
    idx = None if rows is None else torch.tensor(rows)
    cpu = logits.clone()
    apply_grammar_mask(cpu, GrammarMask(bitmask, idx))
    dev = logits.cuda()
    apply_grammar_mask(dev, GrammarMask(bitmask.cuda(), None if idx is None else idx.cuda()))
    assert torch.equal(dev.cpu(), cpu)


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
