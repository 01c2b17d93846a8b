"""On a GPU: YaRN RoPE scaling through every kernel path, and max_model_len 131,072 for Qwen3-0.6B / 8B shapes.

- A tiny YaRN model (original_max_position_embeddings 256, factor 4) with prompts far past 256: the engine on its
  CUDA kernels (bf16: fused qk_norm_rope and the decode megakernel read the scaled cos/sin table) gives HF fp32's
  greedy tokens up to near-ties (the rule of test_engine_e2e_gpu), and the torch path in fp32 gives them exactly.
- The 0.6B and 8B shapes with YaRN factor 4 over 32,768 (Qwen3's documented setting, dummy weights) accept
  max_model_len 131,072, size a KV pool that holds it, and serve one prompt that fills it to the last position.
"""
import json
import random

import pytest
import torch

from minillm import LLM, SamplingParams
from test_engine_e2e_gpu import HF, NEW_TOKENS, assert_greedy_up_to_near_ties
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
VOCAB, ORIG, FACTOR = 1024, 256, 4
YARN = {"rope_type": "yarn", "factor": float(FACTOR), "original_max_position_embeddings": ORIG, "rope_theta": 1e6}


@pytest.fixture(scope="module")
def yarn_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("yarn"), hidden=256, heads=8, kv_heads=2, head_dim=128,
                                intermediate=512, vocab=VOCAB, layers=2, max_positions=ORIG * FACTOR, rope=YARN,
                                seed=27)


def prompts() -> list[list[int]]:
    rng = random.Random(27)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (300, 517, 700, 900, ORIG * FACTOR - NEW_TOKENS)]


def _engine(path, **kw) -> LLM:
    return LLM(str(path), device="cuda", max_model_len=ORIG * FACTOR, num_kv_blocks=512,
               max_num_batched_tokens=256, max_num_seqs=8, **kw)


def test_yarn_cuda_kernels_bf16_match_hf_fp32_up_to_near_ties(yarn_ckpt):
    hf = HF(yarn_ckpt)
    llm = _engine(yarn_ckpt, dtype="bfloat16", kernels="cuda")
    assert llm.model_arch.rope.rope_type == "yarn" and llm.engine.runner.plan.fused_ops.on
    assert_greedy_up_to_near_ties(llm, hf, prompts())


def test_yarn_torch_path_fp32_on_gpu_equals_hf(yarn_ckpt):
    hf = HF(yarn_ckpt)
    llm = _engine(yarn_ckpt, dtype="float32", kernels="torch")
    got = [o.token_ids for o in llm.generate(prompts(), SamplingParams(temperature=0.0, ignore_eos=True,
                                                                       max_tokens=NEW_TOKENS), use_tqdm=False)]
    assert got == [hf.greedy(p) for p in prompts()]


SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_max_model_len_131072_with_yarn(shape, tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 40960, "rope_theta": 1e6, "torch_dtype": "bfloat16", **SHAPES[shape],
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=131072,
              max_num_batched_tokens=8192, max_num_seqs=4, gpu_memory_utilization=0.9)
    runner = llm.engine.runner
    assert runner.max_model_len == 131072 and runner.model.cos_sin_cache.shape == (131072, 128)
    prompt = [random.Random(1).randrange(151936) for _ in range(131072 - 8)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, logprobs=0),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and all(torch.isfinite(torch.tensor(lp.logprob)) for lp in out.logprobs)
