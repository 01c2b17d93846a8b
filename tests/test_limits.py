"""Resource limits: sizes that cannot fit are refused from arithmetic, before any allocation, with advice that
works; the step budget is capped; the CPU KV default follows the model; per-request counts are bounded."""
import re
from types import SimpleNamespace

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import ConfigError
from minillm.limits import (EngineShape, cgroup_free, check_kv_fits, check_request, check_step_fits,
                            check_weights_fit)
from minillm.model.loader import resolve_arch
from minillm.runner import kv_sizing

GiB = 1 << 30
DEMO = resolve_arch(None)


def at_most(message: str) -> int:
    return int(re.search(r"at most ([\d,]+)", message).group(1).replace(",", ""))


def shape(**kw) -> EngineShape:
    base = dict(max_num_seqs=256, max_num_tokens=16384, max_model_len=2048, block_size=16, hidden_size=256,
                intermediate_size=512, q_size=256, kv_size=128, vocab_size=4096, dtype_bytes=4)
    return EngineShape(**{**base, **kw})


# ---------------------------------------------------------------- free memory

def test_cgroup_limits_v1_and_v2(tmp_path):
    proc = tmp_path / "cgroup"
    (tmp_path / "memory" / "job").mkdir(parents=True)
    (tmp_path / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{8 * GiB}\n")
    (tmp_path / "memory" / "job" / "memory.usage_in_bytes").write_text(f"{3 * GiB}\n")
    proc.write_text("4:memory:/job\n1:cpu:/\n")
    assert cgroup_free(proc, tmp_path) == 5 * GiB
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text(f"{2 * GiB}\n")
    (tmp_path / "job" / "memory.current").write_text(f"{GiB}\n")
    proc.write_text("0::/job\n")
    assert cgroup_free(proc, tmp_path) == GiB
    (tmp_path / "job" / "memory.max").write_text("max\n")            # v2 without a limit
    assert cgroup_free(proc, tmp_path) is None
    assert cgroup_free(tmp_path / "missing", tmp_path) is None


# ---------------------------------------------------------------- the arithmetic and its advice

def test_weights_that_cannot_fit_are_refused_naming_the_shape(monkeypatch):
    import minillm.limits as limits
    monkeypatch.setattr(limits, "device_free_bytes", lambda device: 20 * GiB)
    big = SimpleNamespace(num_params=10**12, hidden_size=10**6, vocab_size=4096, num_hidden_layers=4,
                          intermediate_size=512, max_position_embeddings=2048, head_dim=64)
    with pytest.raises(ConfigError, match="hidden_size=1000000") as e:
        check_weights_fit(big, 4, torch.device("cpu"), "model 'x'")
    assert "3.6 TiB" in str(e.value) and "18.0 GiB free" in str(e.value)
    long = SimpleNamespace(**{**vars(big), "num_params": 10**6, "max_position_embeddings": 10**9})
    with pytest.raises(ConfigError, match="max_position_embeddings=1,000,000,000 needs a RoPE table of 476.8 GiB"):
        check_weights_fit(long, 4, torch.device("cpu"), "model 'x'")
    check_weights_fit(DEMO, 4, torch.device("cpu"), "the demo model")


@pytest.mark.parametrize("field, value", [("max_num_seqs", 10**9), ("max_num_tokens", 10**9)])
def test_step_buffers_that_cannot_fit_name_the_setting_and_what_would(field, value):
    free = 16 * GiB
    setting = {"max_num_seqs": "scheduler.max_num_seqs", "max_num_tokens": "scheduler.max_num_batched_tokens"}
    with pytest.raises(ConfigError, match=re.escape(setting[field])) as e:
        check_step_fits(shape(**{field: value}), free, "this machine")
    fit = at_most(str(e.value))
    assert 0 < fit < value
    check_step_fits(shape(**{field: fit}), free, "this machine")     # the advice works
    with pytest.raises(ConfigError):
        check_step_fits(shape(**{field: 2 * fit + 16}), free, "this machine")


def test_kv_pool_that_cannot_fit_says_how_many_blocks_would():
    with pytest.raises(ConfigError, match="cache.num_kv_blocks=1,000,000,000") as e:
        check_kv_fits(10**9, 64 << 10, 4 * GiB, "this machine", "cache.num_kv_blocks=1,000,000,000")
    fit = at_most(str(e.value))
    check_kv_fits(fit, 64 << 10, 4 * GiB, "this machine", "x")
    with pytest.raises(ConfigError):
        check_kv_fits(fit + 1, 64 << 10, 4 * GiB, "this machine", "x")
    check_kv_fits(10**9, 64 << 10, None, "this machine", "x")       # free memory unknown: nothing to refuse


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_kv_blocks=10**9), ["cache.num_kv_blocks=1,000,000,000", "at most"]),
    (dict(max_num_seqs=10**9), ["scheduler.max_num_seqs=1,000,000,000", "at most"]),
])
def test_the_engine_refuses_before_allocating(kwargs, words):
    with pytest.raises(ConfigError) as e:
        LLM(device="cpu", **kwargs)
    for word in words:
        assert word in str(e.value)


def test_a_budget_beyond_any_step_is_capped_not_allocated():
    llm = LLM(device="cpu", max_num_batched_tokens=10**9, max_num_seqs=4, max_model_len=64, num_kv_blocks=32)
    assert llm.engine.runner.max_num_tokens == 4 * 64
    out = llm.generate([[1, 2, 3]] * 6, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [5] * 6


# ---------------------------------------------------------------- the CPU KV default

def cpu_runner(num_params: int, max_num_seqs: int = 256, max_model_len: int = 2048):
    arch = SimpleNamespace(num_params=num_params)
    cfg = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs))
    return SimpleNamespace(arch=arch, cfg=cfg, dtype=torch.float32, max_model_len=max_model_len)


PER_BLOCK = 64 << 10   # the demo model: 16 tokens x 4 layers x K,V x 2 heads x 64 x 4 bytes
PER_SEQ = 128          # blocks of a 2,048-token sequence


@pytest.mark.parametrize("params, seqs, free, blocks", [
    (3_400_000, 256, 64 * GiB, 4_096),        # a small model: 256 MiB, not the 2 GiB of 256 full sequences
    (300_000_000, 256, 64 * GiB, 18_310),     # about the model's own size (1.2 GB of float32 weights)
    (3_000_000_000, 512, 64 * GiB, 32_768),   # never more than 2 GiB
    (3_400_000, 256, 200 << 20, 1_440),       # at most half of the usable free memory (90 MiB of 180)
    (3_400_000, 1, 64 * GiB, 128),            # no more than max_num_seqs full sequences
    (3_400_000, 256, 1 << 20, 128),           # never below one full sequence
])
def test_cpu_default_pool(params, seqs, free, blocks):
    assert kv_sizing._cpu_blocks(cpu_runner(params, seqs), PER_BLOCK, PER_SEQ, free) == blocks


def test_demo_model_pool_on_the_cpu_is_small():
    llm = LLM(device="cpu")
    runner = llm.engine.runner
    assert runner.num_blocks * runner.kv_bytes_per_block() <= 256 << 20
    assert runner.num_blocks >= runner.blocks_for(runner.max_model_len)


# ---------------------------------------------------------------- one request

@pytest.mark.parametrize("params, words", [
    (SamplingParams(n=9), "n=9 is more completions than can run at once: at most scheduler.max_num_seqs=8"),
    (SamplingParams(logprobs=20), "logprobs=20 is more than the vocabulary's 16 tokens"),
    (SamplingParams(stop_token_ids=[3, 16, 99]), "stop_token_ids [16, 99] are outside the vocabulary [0, 16)"),
])
def test_request_counts_and_ids_beyond_the_engine(params, words):
    with pytest.raises(ValueError) as e:
        check_request(params, vocab_size=16, max_num_seqs=8)
    assert str(e.value) == words


def test_request_within_the_engine_passes():
    check_request(SamplingParams(n=8, logprobs=16, stop_token_ids=[0, 15]), vocab_size=16, max_num_seqs=8)


def test_stop_strings_are_bounded_in_count_and_length():
    from minillm.limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
    check_request(SamplingParams(stop=["s"] * MAX_STOP_STRINGS), vocab_size=16, max_num_seqs=8)
    check_request(SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS]), vocab_size=16, max_num_seqs=8)
    with pytest.raises(ValueError, match=f"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"):
        check_request(SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1)), vocab_size=16, max_num_seqs=8)
    with pytest.raises(ValueError, match=f"a string of {MAX_STOP_STRING_CHARS + 1} characters"):
        check_request(SamplingParams(stop=["s" * (MAX_STOP_STRING_CHARS + 1)]), vocab_size=16, max_num_seqs=8)
