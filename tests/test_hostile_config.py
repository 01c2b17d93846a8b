"""Hostile configuration, model directories and output files: every one ends in exit 2 (or 1 for output) with
one `minillm: error:` message naming the key or file, before any work, never a traceback or a hang."""
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.commands import app
from minillm.model.loader import DEMO_MODEL_DIR

FAST = ["--no-progress", "--set", "sampling.max_tokens=2"]


def run(*args, env=None):
    result = CliRunner().invoke(app, [str(a) for a in args], env=env)
    # Exit codes travel as SystemExit; anything else escaped the command and would be a traceback for a user.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def refused(result, *words, code: int = 2) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.stdout == "" if code == 2 else True
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("minillm: error: "), result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "Open the file"}\n')
    return path


def laughs(levels: int = 9) -> str:
    items = ['&l0 [' + ", ".join(['"lol"'] * 9) + ']']
    items += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


# ---------------------------------------------------------------- YAML and --set

@pytest.mark.parametrize("key", ["sampling.stop", "model.model", "scheduler.max_num_seqs"])
def test_alias_bomb_under_a_valid_key_is_refused_at_once(prompts, tmp_path, key):
    section, name = key.split(".")
    config = tmp_path / "bomb.yaml"
    config.write_text(f"{section}:\n  {name}: {laughs()}\n")
    t0 = time.perf_counter()
    refused(run("generate", prompts, "-c", config, *FAST), str(config), "100,000 values")
    refused(run("generate", prompts, "--set", f"{key}={laughs()}", *FAST), f"--set {key}", "100,000 values")
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("item, words", [
    ("sampling.stop=&a [*a]", ["--set sampling.stop", "itself"]),
    ("sampling.stop=" + "[" * 200 + "]" * 200, ["--set sampling.stop", "deeper than 32"]),
    ("runtime.seed=100000000000000000000000000", ["runtime.seed=100000000000000000000000000", "[0, 2**63 - 1]"]),
    ("runtime.seed=-1", ["runtime.seed=-1", "[0, 2**63 - 1]"]),
    ("runtime.seed=1e26", ["runtime.seed='1e26'", "an integer"]),
    ("runtime.device=cuda:x", ["runtime.device='cuda:x'", "cuda:N"]),
    ("model.model=''", ["model.model=''", "null"]),
    ("sampling.temperature=1e308", ["temperature", "at most 10000"]),
    ("sampling.stop={a: 1}", ["stop must be a list"]),
    ("model.model=" + "x" * 5000, ["does not exist"]),
    ("scheduler.max_num_seqs=" + "9" * 50, ["scheduler.max_num_seqs=", "at most"]),
], ids=lambda v: v[:40] if isinstance(v, str) else "")
def test_bad_values_name_the_key(prompts, item, words):
    result = run("generate", prompts, "--set", item, *FAST)
    refused(result, *words)
    assert len(result.stderr) < 1000        # quoted values are cut short


@pytest.mark.parametrize("write, words", [
    (lambda p: p.mkdir(), ["is not a file"]),
    (lambda p: p.write_bytes(b"model:\n  model: \xff\xfe\n"), ["not UTF-8"]),
    (lambda p: p.write_text("a: 1\n" + "#" * (2 << 20)), ["bytes; the limit is"]),
    (lambda p: p.write_text("[" * 100 + "]" * 100), ["deeper than 32"]),
    (lambda p: p.write_text("model: !!python/object/apply:os.system [echo hi]\n"), ["not valid YAML"]),
])
def test_bad_config_files_name_the_file(prompts, tmp_path, write, words):
    config = tmp_path / "c.yaml"
    write(config)
    refused(run("generate", prompts, "-c", config, *FAST), str(config), *words)


# ---------------------------------------------------------------- model directories

@pytest.fixture(scope="module")
def demo_copy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "demo"
    shutil.copytree(DEMO_MODEL_DIR, path)
    return path


def broken_model(demo_copy: Path, tmp_path: Path, config: dict | None = None, files: dict | None = None) -> Path:
    path = tmp_path / "model"
    shutil.copytree(demo_copy, path)
    if config is not None:
        data = json.loads((path / "config.json").read_text())
        data.update(config)
        (path / "config.json").write_text(json.dumps(data))
    for name, content in (files or {}).items():
        (path / name).write_bytes(content)
    return path


@pytest.mark.parametrize("config, words", [
    ({"hidden_size": 10**9}, ["parameters", "TiB", "hidden_size=1000000000", "free to use"]),
    ({"vocab_size": 10**9}, ["vocab_size=1000000000", "free to use"]),
    ({"num_hidden_layers": 10**9}, ["num_hidden_layers=1000000000"]),
    ({"max_position_embeddings": 10**9}, ["max_position_embeddings=1,000,000,000 needs a RoPE table"]),
    ({"num_attention_heads": 10**6, "head_dim": None}, ["head_dim=0", "at least 2"]),
    ({"num_key_value_heads": -1}, ["num_key_value_heads=-1", "positive integer"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads=3", "divisor"]),
    ({"rms_norm_eps": "abc"}, ["rms_norm_eps='abc'"]),
    ({"tie_word_embeddings": "false"}, ["tie_word_embeddings='false'", "true or false"]),
    ({"rope_scaling": [1, 2]}, ["rope_scaling", "an object"]),
    ({"max_position_embeddings": 0}, ["max_position_embeddings=0"]),
    ({"eos_token_id": "</s>"}, ["eos_token_id='</s>'"]),
    ({"architectures": "Qwen4"}, ["architectures=['Qwen4']", "not supported"]),
])
def test_bad_config_json_fields(prompts, demo_copy, tmp_path, config, words):
    model = broken_model(demo_copy, tmp_path, config=config)
    refused(run("generate", prompts, "--model", model, *FAST), *words)


@pytest.mark.parametrize("files, words", [
    ({"config.json": b"[1, 2]"}, ["config.json must hold a JSON object"]),
    ({"config.json": b"[" * 5000 + b"]" * 5000}, ["config.json is not valid JSON", "deeper than 32"]),
    ({"config.json": b"\xff\xfe{}"}, ["config.json is not valid JSON"]),
    ({"model.safetensors": b""}, ["model.safetensors cannot be read", "truncated"]),
    ({"model.safetensors": b"\xff" * 8 + b"{}"}, ["model.safetensors cannot be read", "header"]),
    ({"model.safetensors": (10).to_bytes(8, "little") + b'{"a": "b"}'}, ["model.safetensors cannot be read"]),
    ({"tokenizer.json": b"not a tokenizer"}, ["tokenizer.json is not a tokenizer file"]),
    ({"tokenizer.json": b""}, ["tokenizer.json is not a tokenizer file"]),
    ({"tokenizer_config.json": b"{{{"}, ["tokenizer_config.json is not valid JSON"]),
    ({"chat_template.jinja": b"\xff\xfe"}, ["chat_template.jinja is not UTF-8"]),
    ({"model.safetensors.index.json": b"not json"}, ["model.safetensors.index.json is not valid JSON"]),
    ({"model.safetensors.index.json": b'{"weight_map": {"a": 5}}'}, ["weight_map"]),
])
def test_corrupt_model_files(prompts, demo_copy, tmp_path, files, words):
    model = broken_model(demo_copy, tmp_path, files=files)
    refused(run("generate", prompts, "--model", model, *FAST), *words)


def test_truncated_weights(prompts, demo_copy, tmp_path):
    data = (demo_copy / "model.safetensors").read_bytes()
    model = broken_model(demo_copy, tmp_path, files={"model.safetensors": data[: len(data) // 2]})
    refused(run("generate", prompts, "--model", model, *FAST), "cannot be read", "truncated")


def test_tilde_paths_are_expanded(prompts, demo_copy, tmp_path, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(demo_copy, home / "models" / "demo")
    (home / "c.yaml").write_text("sampling:\n  max_tokens: 2\n")
    monkeypatch.setenv("HOME", str(home))
    result = run("generate", prompts, "--model=~/models/demo", "-c", "~/c.yaml", "-o", "~/out.jsonl", *FAST)
    assert result.exit_code == 0, result.output
    assert json.loads((home / "out.jsonl").read_text())["id"] == "a"
    from minillm import LLM
    assert LLM("~/models/demo", device="cpu").model_arch.vocab_size == 4096


# ---------------------------------------------------------------- inputs and outputs

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_is_reported_not_raised(prompts):
    refused(run("generate", prompts, "-o", "/dev/full", *FAST), "cannot write answers to /dev/full",
            "No space left", code=1)


def test_input_that_is_a_directory(tmp_path):
    refused(run("generate", tmp_path, *FAST), "is not a file")


def test_bench_flags_are_refused_before_any_work(tmp_path):
    refused(run("bench", "-o", tmp_path / "b.jsonl", "--set", "scheduler.max_num_seqs=0"), "max_num_seqs=0")
    refused(run("latency-sweep", "-o", tmp_path / "l.jsonl", "--rates", "inf"), "--rates='inf'")
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"rates: 4\nengine: {laughs()}\n")
    refused(run("latency-sweep", "--suite", suite), "100,000 values")
    workload = tmp_path / "w.yaml"
    for text, words in [("num_requests: 1000000000\n", "num_requests=1000000000"),
                        ("prompt_len: 5\n", "prompt_len=5"), ("kind: [1]\n", "kind=[1]"),
                        ("num_requests: 100000\nprompt_len: [1, 100000]\nmax_model_len: 200000\n", "the limit is")]:
        workload.write_text(text)
        refused(run("bench", "--workload", workload), words)
