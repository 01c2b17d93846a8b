"""One validation for every way a config is built: YAML, --set, flags, LLM(**kw) and the dataclasses themselves."""
import dataclasses

import pytest

from minillm.config import ConfigError, EngineConfig, RuntimeConfig, SchedulerConfig
from minillm.config_loader import load_config
from minillm.llm import LLM
from minillm.untrusted import load_yaml

WRONG = {"bool": "false", "int": True, "float": "0.5", "str": 7}   # a value of the wrong type, per annotation


def _fields():
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(getattr(EngineConfig(), section.name)):
            yield section.name, f


def _kwarg(section: str, key: str) -> str:
    return next(k for k, target in EngineConfig.KWARGS.items() if target == (section, key))


@pytest.mark.parametrize("kw, words", [
    ({"enforce_eager": "no"}, ["runtime.enforce_eager='no'", "true or false"]),
    ({"async_scheduling": "false"}, ["runtime.async_scheduling='false'", "true or false"]),
    ({"max_num_seqs": True}, ["scheduler.max_num_seqs=True", "an integer"]),
    ({"block_size": 16.0}, ["cache.block_size=16.0", "an integer"]),
    ({"seed": 1.5}, ["runtime.seed=1.5", "an integer"]),
])
def test_llm_keywords_are_type_checked_before_any_engine_work(kw, words):
    with pytest.raises(ConfigError) as e:
        LLM(**kw)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("section, field", [(s, f) for s, f in _fields() if s != "model" or f.name != "model"],
                         ids=lambda x: getattr(x, "name", x))
def test_every_field_refuses_a_wrong_type_on_every_path(section, field):
    kind = str(field.type).split("|")[0].strip()
    bad = WRONG[kind]
    expected = f"{section}.{field.name}="
    with pytest.raises(ConfigError, match="wrong type") as e:
        load_config(None, [f"{section}.{field.name}={bad!r}" if isinstance(bad, str) else
                           f"{section}.{field.name}={str(bad).lower()}"])
    assert expected in str(e.value)
    with pytest.raises(ConfigError, match="wrong type") as e:
        EngineConfig.from_kwargs(**{_kwarg(section, field.name): bad})
    assert expected in str(e.value)
    sec = dataclasses.replace(getattr(EngineConfig(), section), **{field.name: bad})
    with pytest.raises(ConfigError, match="wrong type") as e:
        EngineConfig(**{section: sec}).validate()
    assert expected in str(e.value)


def test_model_name_of_the_wrong_type_is_refused():
    with pytest.raises(ConfigError, match="model.model=7"):
        EngineConfig.from_kwargs(7)


def test_hand_built_sections_are_checked_like_yaml():
    with pytest.raises(ConfigError, match="runtime.enforce_eager='no'"):
        LLM.from_config(EngineConfig(runtime=RuntimeConfig(enforce_eager="no")))
    with pytest.raises(ConfigError, match="scheduler.max_num_seqs=0"):
        EngineConfig(scheduler=SchedulerConfig(max_num_seqs=0)).validate()
    with pytest.raises(ConfigError, match="EngineConfig.cache must be a CacheConfig"):
        EngineConfig(cache={"block_size": 16}).validate()


def test_right_types_pass_and_ints_count_as_numbers():
    cfg = EngineConfig.from_kwargs(enforce_eager=True, max_num_seqs=8, gpu_memory_utilization=0.5)
    assert (cfg.runtime.enforce_eager, cfg.scheduler.max_num_seqs) == (True, 8)
    assert load_config(None, ["cache.gpu_memory_utilization=0.5"])[0].cache.gpu_memory_utilization == 0.5


@pytest.mark.parametrize("text, key, line", [
    ("sampling:\n  temperature: 0.5\nscheduler:\n  max_num_seqs: 4\nsampling:\n  temperature: 0.9\n",
     "'sampling'", 5),
    ("cache:\n  block_size: 16\n  block_size: 32\n", "'block_size'", 3),
    ("sampling:\n  stop: {a: 1, a: 2}\n", "'a'", 2),
])
def test_duplicate_keys_are_refused_naming_key_and_file(tmp_path, text, key, line):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and f"duplicate key {key}" in msg and f"line {line}," in msg


def test_merge_key_override_is_not_a_duplicate():
    # A key that overrides one brought in by `<<` is YAML's documented way to extend an anchor.
    assert load_yaml("a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\n")["d"] == {"b": 3, "c": 2}


def test_duplicate_key_in_set_value_is_refused():
    with pytest.raises(ConfigError, match="--set sampling.stop: .*duplicate key 'a'"):
        load_config(None, ["sampling.stop={a: 1, a: 2}"])


def test_host_threads_leaves_torchs_own_setting_unless_given():
    from minillm.config import RuntimeConfig
    assert RuntimeConfig().host_threads_for() is None
    assert RuntimeConfig(host_threads=6).host_threads_for() == 6
    for bad in (0, 2000, "many"):
        with pytest.raises(ConfigError, match="runtime.host_threads"):
            EngineConfig.from_kwargs(host_threads=bad)
