"""Fuzz: random JSON values in every request field, random bytes as lines, random YAML at the config loader.

Whatever comes in: no exception escapes, every line gets exactly one answer (generate) or one final event
(serve-stdin) in order, the engine is left empty, and exit codes stay within 0/1/2. The engine is the demo model,
loaded once with a short context, so accepted requests finish in a few steps.
"""
import io
import json
import os
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.config import ConfigError
from minillm.config_loader import load_config
from minillm.serve.generate_jsonl import run_generate
from minillm.serve.requests import ALLOWED_KEYS
from minillm.serve.stdin_server import StdinServer

FIELDS = (*ALLOWED_KEYS, "colour")
DEFAULTS = {"temperature": 0.0, "max_tokens": 2}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-3, 40)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
# A random subset of the fields over a base that is valid, so that fuzzing reaches past the first check.
requests = st.builds(lambda base, extra: {**base, **extra},
                     st.sampled_from([{}, {"prompt": "Open the file"}, {"prompt_token_ids": [5, 6]},
                                      {"messages": [{"role": "user", "content": "hi"}]}]),
                     st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4))
lines = st.lists(requests.map(lambda r: json.dumps(r).encode()) | st.binary(max_size=30), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def llm():
    from minillm import LLM
    return LLM(device="cpu", max_model_len=16, max_num_seqs=4, num_kv_blocks=32)


def line_id(raw: bytes, n: int):
    """The id an answer to `raw` (line n) must carry: its own valid id, else the line number."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return n
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else n


@FUZZ
@given(batch=lines)
def test_generate_answers_every_random_line(llm, batch):
    numbered = [(n, raw) for n, raw in enumerate(batch, 1) if raw.strip()]
    out = io.BytesIO()
    summary = run_generate(llm, numbered, DEFAULTS, out, progress=False)
    got = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [a["id"] for a in got] == [line_id(raw, n) for n, raw in numbered]
    assert all(("error" in a) != ("finish_reason" in a) for a in got)
    # engine_error is the answer to an unexpected exception: a bad value must be refused before that
    assert not [a for a in got if a.get("error", {}).get("type") == "engine_error"]
    assert summary.exit_code in (0, 1) and not llm.has_unfinished_requests()


@FUZZ
@given(batch=lines)
def test_serve_stdin_ends_every_random_line(llm, batch):
    batch = [raw for raw in batch if b"\n" not in raw and b"abort" not in raw and raw.strip()]
    out = io.BytesIO()
    assert StdinServer(llm, DEFAULTS, out).serve(io.BytesIO(b"".join(raw + b"\n" for raw in batch))) == 0
    finals = [e for e in map(json.loads, out.getvalue().splitlines()) if e["event"] in ("done", "error")]
    assert len(finals) == len(batch) and not llm.has_unfinished_requests()
    assert not [e for e in finals if e["event"] == "error" and e["error"]["type"] == "engine_error"]


# ---------------------------------------------------------------- the config loader

SECTIONS = ("model", "cache", "scheduler", "runtime", "sampling", "nope")
KEYS = ("model", "dtype", "max_model_len", "block_size", "num_kv_blocks", "gpu_memory_utilization",
        "max_num_seqs", "max_num_batched_tokens", "policy", "device", "seed", "stop", "temperature", "n", "typo")
configs = st.dictionaries(st.sampled_from(SECTIONS) | json_values.filter(lambda v: isinstance(v, str)),
                          st.dictionaries(st.sampled_from(KEYS), json_values, max_size=4) | json_values,
                          max_size=4)
yaml_texts = (configs.map(lambda d: yaml.safe_dump(d, default_flow_style=True))
              | st.text(alphabet="[]{}:&*!|>-'\"#,. \nabcx19", max_size=60))


@FUZZ
@given(text=yaml_texts, sets=st.lists(st.tuples(st.sampled_from(SECTIONS), st.sampled_from(KEYS),
                                                  st.text(alphabet="[]{}:&*!-'\", abx19.e", max_size=20)),
                                        max_size=3))
def test_config_loader_answers_or_names_the_problem(tmp_path, text, sets):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    try:
        cfg, sampling = load_config(path, [f"{s}.{k}={v}" for s, k, v in sets])
    except ConfigError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) < 2000
    else:
        assert cfg.validate() is cfg and isinstance(sampling, dict)


def test_one_random_run_through_the_process(tmp_path):
    """The same promise end to end, on a fixed handful of such lines: exit status 1 (some failed), one answer
    per line in order, nothing on stderr."""
    raw = [b'{"id": "a", "prompt": "x", "stop": {"b": [[[[1]]]]}, "n": 3}', b"\xff\xfe", b"[" * 300,
           b'{"prompt_token_ids": [1, 2], "top_k": 1e300, "seed": 1e400}', b'{"id": true, "prompt": "y"}',
           json.dumps({"id": 7, "prompt": "z", "max_tokens": 2, "logprobs": 3, "n": 2, "seed": -5}).encode()]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(raw) + b"\n")
    env = {**os.environ}
    proc = subprocess.run([sys.executable, "-m", "minillm", "generate", str(path), "--device", "cpu",
                           "--no-progress", "--max-model-len", "64"], capture_output=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr.decode()
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [a["id"] for a in got] == ["a", 2, 3, 4, 5, 7]
    assert "error" not in got[-1] and len(got[-1]["outputs"]) == 2
    assert proc.stderr == b""
