"""RoPE scaling (YaRN, linear) read from config.json as HF transformers computes it: the cos/sin table is
bit-identical to transformers' rotary embedding, unsupported types are refused by name, and the engine's greedy
tokens equal HF's on prompts far past original_max_position_embeddings."""
import copy
import random

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import ConfigError
from minillm.model.arch import ModelArchConfig
from minillm.model.rope import RopeScaling, cos_sin_table
from tiny_models import hf_greedy, make_tiny_checkpoint

BASE = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=512)
YARN_64x4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

TABLE_CASES = {
    "yarn-rope_scaling": dict(rope_scaling=YARN_64x4),
    "yarn-old-type-key-qwen3-docs": dict(rope_scaling={"type": "yarn", "factor": 4,
                                                       "original_max_position_embeddings": 32768},
                                         max_position_embeddings=40960, rope_theta=1e6),
    "yarn-betas-no-truncate": dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                                                    "beta_slow": 2, "truncate": False,
                                                    "original_max_position_embeddings": 128, "rope_theta": 5e5}),
    "yarn-mscale": dict(rope_parameters={**YARN_64x4, "mscale": 0.8, "mscale_all_dim": 0.5, "rope_theta": 1e4}),
    "yarn-attention-factor": dict(rope_parameters={**YARN_64x4, "attention_factor": 1.3, "rope_theta": 1e4}),
    "yarn-zero-betas-mean-defaults": dict(rope_parameters={**YARN_64x4, "beta_fast": 0, "beta_slow": 0}),
    "yarn-no-original": dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
    "yarn-top-level-original-wins": dict(rope_parameters={**YARN_64x4, "rope_theta": 1e4},
                                         original_max_position_embeddings=128),
    "yarn-null-factor-is-length-ratio": dict(rope_parameters={"rope_type": "yarn", "factor": None,
                                                              "original_max_position_embeddings": 128}),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.5}, rope_theta=1e4),
    "linear-rope_parameters": dict(rope_parameters={"rope_type": "linear", "factor": 3, "rope_theta": 1e6}),
}


def _arch(extra: dict) -> tuple[ModelArchConfig, dict]:
    d = {**BASE, **copy.deepcopy(extra)}
    return ModelArchConfig.from_hf_dict(copy.deepcopy(d)), d


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_table_is_bit_identical_to_transformers(case):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    arch, d = _arch(TABLE_CASES[case])
    hf = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in d.items() if k != "architectures"}))
    positions = torch.tensor([[0, 1, 31, 63, 64, 65, 200, 255, 511]])
    cos, sin = hf(torch.zeros(1), positions)
    table = cos_sin_table(32, arch.max_position_embeddings, arch.rope)
    assert arch.rope.attention_factor == pytest.approx(hf.attention_scaling, abs=0)
    assert torch.equal(table[positions[0], :16], cos[0, :, :16])
    assert torch.equal(table[positions[0], 16:], sin[0, :, :16])
    assert arch.rope_scaling is not None   # the scaled table really differs from plain RoPE
    plain = cos_sin_table(32, arch.max_position_embeddings, RopeScaling(theta=arch.rope_theta))
    assert not torch.equal(table, plain)


def test_yarn_factor_scales_cos_and_sin_by_its_attention_factor():
    arch, _ = _arch({"rope_parameters": YARN_64x4})
    table = cos_sin_table(32, 8, arch.rope)
    # cos^2 + sin^2 of every row equals the attention factor squared (0.1 ln 4 + 1 for factor 4).
    norm = table[:, :16] ** 2 + table[:, 16:] ** 2
    torch.testing.assert_close(norm, torch.full_like(norm, (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2))


@pytest.mark.parametrize("shape,max_pos", [("0.6b", 40960), ("8b", 40960)])
def test_yarn_extends_qwen3_shapes_to_131072(shape, max_pos):
    d = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128, "rope_theta": 1e6,
         "max_position_embeddings": max_pos,
         **({"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8} if shape == "0.6b" else
            {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
             "num_key_value_heads": 8}),
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    arch = ModelArchConfig.from_hf_dict(d)
    assert arch.max_position_embeddings == 131072
    table = cos_sin_table(arch.head_dim, arch.max_position_embeddings, arch.rope)
    assert table.shape == (131072, 128) and torch.isfinite(table).all()
    # Without scaling the same config stops at max_position_embeddings.
    plain = ModelArchConfig.from_hf_dict({**d, "rope_scaling": None})
    assert plain.max_position_embeddings == max_pos


@pytest.mark.parametrize("params,words", [
    ({"rope_type": "dynamic", "factor": 2.0}, ["'dynamic'", "not supported", "yarn"]),
    ({"type": "longrope", "factor": 2.0}, ["'longrope'", "not supported"]),
    ({"rope_type": "llama3", "factor": 8.0}, ["'llama3'"]),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}, ["factor=0.5", ">= 1"]),
    ({"rope_type": "yarn", "factor": "4"}, ["factor='4'"]),
    ({"rope_type": "linear"}, ["factor=None"]),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     ["original_max_position_embeddings=0"]),
    ({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, ["low_freq_factor"]),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, ["truncate='no'"]),
])
def test_unsupported_or_bad_rope_is_refused_by_name(params, words):
    for key in ("rope_scaling", "rope_parameters"):
        with pytest.raises(ConfigError) as e:
            ModelArchConfig.from_hf_dict({**BASE, key: dict(params)})
        for w in words:
            assert w in str(e.value)


def test_rope_scaling_spelling_wins_over_rope_parameters_as_in_transformers():
    arch, _ = _arch({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert arch.rope.rope_type == "linear" and arch.max_position_embeddings == 1024


# ---------------------------------------------------------------- the engine against HF, far past the original length

ORIG, FACTOR, MAX_LEN, NEW = 64, 4, 256, 10


@pytest.fixture(scope="module")
def yarn_dir(tmp_path_factory):
    rope = {**YARN_64x4, "rope_theta": 10000.0}
    return make_tiny_checkpoint(tmp_path_factory.mktemp("yarn"), vocab=256, seed=11, max_positions=MAX_LEN,
                                rope=rope)


@pytest.fixture(scope="module")
def linear_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("linear"), vocab=256, seed=12, max_positions=128,
                                rope={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})


def _prompts(seed, lens):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lens]


@pytest.mark.parametrize("budget", [None, 48])
def test_yarn_engine_equals_hf_far_past_original_length(yarn_dir, budget):
    prompts = _prompts(1, [210, 243, 70])
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(str(yarn_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True, **kw)
    assert llm.model_arch.rope.rope_type == "yarn" and llm.model_arch.max_position_embeddings == ORIG * FACTOR
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(yarn_dir, p, NEW)


def test_yarn_prefix_hit_equals_hf(yarn_dir):
    shared = _prompts(2, [200])[0]
    prompts = [shared + [5, 6, 7], shared + [9] * 20]
    llm = LLM(str(yarn_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompts[0]], sp, use_tqdm=False)[0]
    second = llm.generate([prompts[1]], sp, use_tqdm=False)[0]
    assert second.num_cached_tokens == 192
    assert first.token_ids == hf_greedy(yarn_dir, prompts[0], 6)
    assert second.token_ids == hf_greedy(yarn_dir, prompts[1], 6)


def test_linear_engine_equals_hf_past_config_length(linear_dir):
    prompts = _prompts(3, [200, 130])   # max_position_embeddings 128, linear factor 2: 256 positions
    llm = LLM(str(linear_dir), device="cpu", dtype="float32", max_model_len=256, check_integrity=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(linear_dir, p, NEW)


def test_engine_accepts_max_model_len_131072_with_yarn(tmp_path):
    """Qwen3's documented YaRN setting (factor 4 over 32,768) lifts the engine's limit to 131,072 positions; one
    past it is refused by name."""
    path = make_tiny_checkpoint(tmp_path / "m", vocab=256, layers=1, max_positions=40960,
                                rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                      "rope_theta": 1e6})
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=131072, num_kv_blocks=8192 + 1,
              max_num_batched_tokens=256)
    assert llm.engine.runner.model.cos_sin_cache.shape == (131072, 16)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 2
    with pytest.raises(ConfigError, match="max_model_len=131073"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=131073, num_kv_blocks=8192 + 2)
