"""Bad input: every bad line gets exactly one clear answer carrying its id, the rest are served, order is kept;
usage and model errors stop with exit status 2 before any work."""
import io
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minillm.commands import app
from minillm.sampling_params import SamplingParams
from minillm.serve.requests import (MAX_LINE_BYTES, AbortCommand, LineError, ParsedRequest, TooLong, iter_lines,
                                    parse_line)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SMALL = ["--device", "cpu", "--set", "cache.num_kv_blocks=64", "--set", "sampling.temperature=0",
         "--set", "sampling.max_tokens=3", "--no-progress"]


def parse(line, allow_abort: bool = False, line_no: int = 7):
    raw = line if isinstance(line, (bytes, TooLong)) else json.dumps(line).encode()
    return parse_line(line_no, raw, {"max_tokens": 4}, allow_abort=allow_abort)


def error_of(line, **kw) -> LineError:
    with pytest.raises(LineError) as e:
        parse(line, **kw)
    return e.value


# ---------------------------------------------------------------- one line -> request or error

def test_good_lines_parse():
    req = parse({"id": "a", "prompt": "hi", "temperature": 0, "stop": ".", "priority": 2})
    assert req == ParsedRequest("a", "hi", SamplingParams(temperature=0, stop=["."], max_tokens=4), 2)
    assert parse({"prompt_token_ids": [1, 2]}).id == 7            # no id: the line number
    assert parse(b'\xef\xbb\xbf{"prompt": "bom"}').prompt == "bom"  # a UTF-8 byte-order mark is tolerated
    msgs = [{"role": "user", "content": "x"}]
    assert parse({"id": 3, "messages": msgs, "max_tokens": 9}).params.max_tokens == 9
    assert parse({"abort": "a"}, allow_abort=True) == AbortCommand("a")


@pytest.mark.parametrize("raw, kind, words", [
    (b'{"prompt": "x"', "invalid_json", ["line 7", "not valid JSON"]),
    (b'{"prompt": NaN}', "invalid_json", ["NaN"]),
    (b'["prompt"]', "invalid_request", ["JSON object", "list"]),
    (b'"just a string"', "invalid_request", ["JSON object", "str"]),
    (b'{"prompt": "caf\xe9"}', "invalid_encoding", ["not valid UTF-8"]),
    (b'\xff\xfe{}', "invalid_encoding", ["not valid UTF-8", "byte 0"]),
    (TooLong(10 << 20), "line_too_long", [str(10 << 20), str(MAX_LINE_BYTES)]),
])
def test_unreadable_lines_answer_with_the_line_number(raw, kind, words):
    err = error_of(raw)
    assert (err.id, err.type) == (7, kind)
    for word in words:
        assert word in err.message


@pytest.mark.parametrize("line, words", [
    ({"id": "q"}, ["exactly one of prompt, messages, prompt_token_ids", "none"]),
    ({"id": "q", "prompt": "a", "prompt_token_ids": [1]}, ["exactly one", "prompt, prompt_token_ids"]),
    ({"id": "q", "prompt": ""}, ["prompt must be a non-empty string"]),
    ({"id": "q", "prompt": 5}, ["prompt must be a non-empty string", "5"]),
    ({"id": "q", "prompt_token_ids": []}, ["prompt_token_ids must be"]),
    ({"id": "q", "prompt_token_ids": [1, "2"]}, ["prompt_token_ids must be a non-empty list of non-negative"]),
    ({"id": "q", "prompt_token_ids": [1, -2]}, ["prompt_token_ids"]),
    ({"id": "q", "prompt_token_ids": [True]}, ["prompt_token_ids"]),
    ({"id": "q", "messages": "hi"}, ["messages must be"]),
    ({"id": "q", "messages": [{"role": "user"}]}, ["messages must be"]),
    ({"id": "q", "messages": [{"role": "user", "content": "x", "name": "y"}]}, ["messages must be"]),
    ({"id": "q", "prompt": "a", "max_tokns": 3, "colour": 1}, ["unknown field(s) 'colour', 'max_tokns'"]),
    ({"id": "q", "prompt": "a", "max_tokens": 0}, ["max_tokens must be an integer >= 1", "0"]),
    ({"id": "q", "prompt": "a", "max_tokens": "8"}, ["max_tokens must be an integer >= 1"]),
    ({"id": "q", "prompt": "a", "temperature": -0.5}, ["temperature must be a finite number >= 0", "-0.5"]),
    ({"id": "q", "prompt": "a", "temperature": "hot"}, ["temperature"]),
    ({"id": "q", "prompt": "a", "top_p": 0}, ["top_p must be in (0, 1]", "0"]),
    ({"id": "q", "prompt": "a", "top_p": 1.5}, ["top_p must be in (0, 1]", "1.5"]),
    ({"id": "q", "prompt": "a", "top_k": 1.5}, ["top_k"]),
    ({"id": "q", "prompt": "a", "stop": [1]}, ["stop"]),
    ({"id": "q", "prompt": "a", "priority": "high"}, ["priority must be an integer"]),
    ({"id": "q", "prompt": "a", "seed": 1.5}, ["seed"]),
])
def test_invalid_requests_answer_with_their_id(line, words):
    err = error_of(line)
    assert (err.id, err.type) == ("q", "invalid_request")
    for word in words:
        assert word in err.message


def test_overflowing_number_is_refused():
    err = error_of(b'{"id": "q", "prompt": "a", "temperature": 1e999}')
    assert err.id == "q" and "finite" in err.message


@pytest.mark.parametrize("line", [{"id": [1], "prompt": "a"}, {"id": True, "prompt": "a"}, {"id": 1.5}])
def test_bad_id_falls_back_to_the_line_number(line):
    err = error_of(line)
    assert err.id == 7 and "id must be a string or an integer" in err.message


@pytest.mark.parametrize("line", [{"abort": "a", "prompt": "x"}, {"abort": [1]}])
def test_bad_abort_lines(line):
    assert error_of(line, allow_abort=True).type == "invalid_request"


def test_abort_is_an_unknown_field_where_not_allowed():
    assert "unknown field(s) 'abort'" in error_of({"abort": "a"}).message


# ---------------------------------------------------------------- reading lines

def test_iter_lines_caps_long_lines_and_keeps_the_next():
    data = b'{"a": 1}\n' + b"x" * 100 + b"\n\n" + b"y" * 10 + b"\n" + b"z" * 30
    items = list(iter_lines(io.BytesIO(data), max_bytes=20))
    assert items == [(1, b'{"a": 1}'), (2, TooLong(100)), (3, b""), (4, b"y" * 10), (5, TooLong(30))]


def test_iter_lines_across_read_chunks(monkeypatch):
    import minillm.serve.requests as requests_mod
    monkeypatch.setattr(requests_mod, "_READ_CHUNK", 3)   # lines and the cap straddle every chunk boundary
    data = b"abcdefg\nhi\n" + b"k" * 11 + b"\nlast"
    assert list(iter_lines(io.BytesIO(data), max_bytes=10)) == [
        (1, b"abcdefg"), (2, b"hi"), (3, TooLong(11)), (4, b"last")]


# ---------------------------------------------------------------- whole runs through the CLI

def run_cli(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def answers(result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_every_bad_line_answered_in_order_and_good_ones_served(tiny_model, tmp_path):
    lines = [
        b'{"id": "ok1", "prompt": "The function"}',
        b'{"id": "broken", "prompt": ',
        b'[1, 2, 3]',
        b'{"id": "noprompt"}',
        b'{"id": "empty", "prompt": ""}',
        b'{"id": "type", "prompt": 42}',
        b'{"id": "unknown", "prompt": "a", "colour": "red"}',
        b'{"id": "toolong", "prompt_token_ids": ' + json.dumps([5] * 600).encode() + b'}',
        b'{"id": "maxtok", "prompt": "a", "max_tokens": 0}',
        b'{"id": "temp", "prompt": "a", "temperature": -1}',
        b'{"id": "topp", "prompt": "a", "top_p": 1.5}',
        b'{"id": "vocab", "prompt_token_ids": [1, 99999]}',
        b'{"id": "latin1", "prompt": "caf\xe9"}',
        b'{"id": "huge", "prompt": "' + b"a" * (10 << 20) + b'"}',
        b'',
        b'{"id": "ok2", "messages": [{"role": "user", "content": "Hello"}]}',
        b'{"prompt_token_ids": [3, 4, 5]}',
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = run_cli("generate", path, "--model", tiny_model, *SMALL)
    assert result.exit_code == 1, result.output
    got = answers(result)
    expected_ids = ["ok1", 2, 3, "noprompt", "empty", "type", "unknown", "toolong", "maxtok", "temp", "topp",
                    "vocab", 13, 14, "ok2", 17]
    assert [a["id"] for a in got] == expected_ids          # one answer per non-blank line, in input order
    served = {a["id"] for a in got if "error" not in a}
    assert served == {"ok1", "ok2", 17}
    for a in got:
        if "error" in a:
            assert set(a["error"]) == {"type", "message"} and a["error"]["message"]
        else:
            assert a["finish_reason"] in ("stop", "length") and 1 <= a["usage"]["completion_tokens"] <= 3
    errors = {a["id"]: a["error"] for a in got if "error" in a}
    assert "max_model_len" in errors["toolong"]["message"]
    assert "vocabulary" in errors["vocab"]["message"]
    assert errors[13]["type"] == "invalid_encoding" and errors[14]["type"] == "line_too_long"


def test_empty_input_file_is_a_usage_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    result = run_cli("generate", path)
    assert result.exit_code == 2 and "has no request lines" in result.stderr


def test_missing_input_file_is_a_usage_error(tmp_path):
    result = run_cli("generate", tmp_path / "nope.jsonl")
    assert result.exit_code == 2 and "input file not found" in result.stderr and "nope.jsonl" in result.stderr


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    return path


def test_model_dir_without_config_json(tiny_model, tmp_path, prompts_file):
    bad = tmp_path / "noconfig"
    shutil.copytree(tiny_model, bad)
    (bad / "config.json").unlink()
    result = run_cli("generate", prompts_file, "--model", bad, *SMALL)
    assert result.exit_code == 2 and "config.json" in result.stderr and result.stdout == ""


def test_model_dir_without_weights(tiny_model, tmp_path, prompts_file):
    bad = tmp_path / "noweights"
    shutil.copytree(tiny_model, bad)
    (bad / "model.safetensors").unlink()
    result = run_cli("generate", prompts_file, "--model", bad, *SMALL)
    assert result.exit_code == 2 and "safetensors" in result.stderr and result.stdout == ""


def test_unsupported_architecture(tiny_model, tmp_path, prompts_file):
    bad = tmp_path / "llama"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    result = run_cli("generate", prompts_file, "--model", bad, *SMALL)
    assert result.exit_code == 2 and "LlamaForCausalLM" in result.stderr and "not supported" in result.stderr


def test_missing_model_dir(tmp_path, prompts_file):
    result = run_cli("generate", prompts_file, "--model", tmp_path / "absent", *SMALL)
    assert result.exit_code == 2 and "does not exist" in result.stderr
