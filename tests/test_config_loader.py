"""YAML config loading, --set overrides, flag precedence, and the messages of every config mistake."""
from pathlib import Path

import pytest

from minillm.config import ConfigError, EngineConfig
from minillm.config_loader import SAMPLING_DEFAULTS, load_config, parse_set

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_default_yaml_equals_builtin_defaults():
    # configs/default.yaml documents every key; it must not drift from the dataclass and sampling defaults.
    assert load_config(CONFIGS / "default.yaml") == load_config(None) == (EngineConfig(), SAMPLING_DEFAULTS)


def test_qwen3_yaml_loads_real_model_settings():
    cfg, sampling = load_config(CONFIGS / "qwen3-0.6b.yaml")
    assert cfg.model.dtype == "bfloat16" and cfg.runtime.device == "cuda"
    assert sampling["top_k"] == 20


def test_yaml_then_set_then_flags(tmp_path):
    path = write(tmp_path, "scheduler:\n  max_num_batched_tokens: 512\n  max_num_seqs: 8\nsampling:\n  top_k: 5\n")
    cfg, sampling = load_config(path, ["scheduler.max_num_batched_tokens=1024", "sampling.temperature=0"],
                                max_num_batched_tokens=2048, device=None)
    assert cfg.scheduler.max_num_batched_tokens == 2048        # the explicit flag wins
    assert cfg.scheduler.max_num_seqs == 8                     # the file's value is kept
    assert cfg.runtime.device == "auto"                        # a None flag means "not given"
    assert sampling == {**SAMPLING_DEFAULTS, "top_k": 5, "temperature": 0}


def test_flags_use_engine_kwarg_names():
    cfg, _ = load_config(None, model="some/dir", enable_chunked_prefill=False, scheduling_policy="priority",
                         enforce_eager=True, attention="torch", attention_mode="unified", max_model_len=64)
    assert cfg.model.model == "some/dir" and cfg.model.max_model_len == 64
    assert not cfg.scheduler.enable_chunked_prefill and cfg.scheduler.policy == "priority"
    assert cfg.runtime.enforce_eager and cfg.runtime.attention == "torch"
    assert cfg.runtime.attention_mode == "unified"


@pytest.mark.parametrize("item, expected", [
    ("model.max_model_len=null", ("model", "max_model_len", None)),
    ("cache.enable_prefix_caching=false", ("cache", "enable_prefix_caching", False)),
    ("cache.gpu_memory_utilization=0.5", ("cache", "gpu_memory_utilization", 0.5)),
    ("model.model=a=b", ("model", "model", "a=b")),
    ("sampling.stop=[x, y]", ("sampling", "stop", ["x", "y"])),
])
def test_parse_set_reads_values_as_yaml(item, expected):
    assert parse_set(item) == expected


@pytest.mark.parametrize("item", ["cache.block_size", "block_size=16", ".x=1", "cache.=1"])
def test_malformed_set_is_refused(item):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, [item])


@pytest.mark.parametrize("sets, words", [
    (["cahce.block_size=16"], ["'cahce'", "did you mean 'cache'"]),
    (["cache.blok_size=16"], ["'blok_size'", "did you mean 'block_size'"]),
    (["sampling.tempreature=0"], ["'tempreature'", "did you mean 'temperature'"]),
    (["scheduler.max_num_seq=4"], ["'max_num_seq'", "did you mean 'max_num_seqs'"]),
])
def test_unknown_keys_suggest_the_nearest(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("sets, words", [
    (["cache.block_size=true"], ["cache.block_size=True", "an integer"]),
    (["cache.block_size=16.0"], ["cache.block_size=16.0", "an integer"]),
    (["scheduler.max_num_seqs=many"], ["scheduler.max_num_seqs='many'", "an integer"]),
    (["cache.enable_prefix_caching=2"], ["cache.enable_prefix_caching=2", "true or false"]),
    (["model.max_model_len=[1]"], ["model.max_model_len=[1]", "an integer or null"]),
    (["runtime.device=7"], ["runtime.device=7", "a string"]),
])
def test_wrong_types_name_key_value_and_allowed(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("sets, words", [
    (["cache.block_size=3"], ["cache.block_size=3", "8, 16, 32, 64"]),
    (["scheduler.max_num_seqs=0"], ["scheduler.max_num_seqs=0", ">= 1"]),
    (["cache.gpu_memory_utilization=1.5"], ["cache.gpu_memory_utilization=1.5", "[0.05, 0.99]"]),
    (["scheduler.policy=lifo"], ["scheduler.policy='lifo'", "fcfs, priority, static"]),
    (["sampling.temperature=-1"], ["sampling", "temperature", ">= 0"]),
    (["sampling.top_p=0"], ["sampling", "top_p", "(0, 1]"]),
    (["sampling.max_tokens=0"], ["sampling", "max_tokens", ">= 1"]),
])
def test_out_of_range_values_name_key_value_and_allowed(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    for word in words:
        assert word in str(e.value)


def test_bad_flag_value_is_a_config_error():
    with pytest.raises(ConfigError, match="runtime.attention='triton'"):
        load_config(None, attention="triton")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, words", [
    ("model: [unclosed\n", ["not valid YAML"]),
    ("- model\n- cache\n", ["must be a mapping of sections"]),
    ("cache: 16\n", ["'cache'", "must be a mapping"]),
    ("caches:\n  block_size: 16\n", ["'caches'", "did you mean 'cache'"]),
    ("cache:\n  block_size: 12\n", ["cache.block_size=12"]),
])
def test_bad_yaml_files(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    for word in words:
        assert word in str(e.value)


def test_empty_file_and_empty_section_keep_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == load_config(None)
    assert load_config(write(tmp_path, "cache:\n")) == load_config(None)
