"""Hostile request lines: deep structures, huge numbers and counts, wrong shapes. Each gets exactly one answer
with its id, the other lines are served in order, in generate and serve-stdin alike; SIGTERM and a closed
stdout end a run cleanly (subprocess, since they are about the process)."""
import io
import json
import os
import signal
import subprocess
import sys

import pytest

from minillm.serve.generate_jsonl import run_generate
from minillm.serve.stdin_server import StdinServer

DEFAULTS = {"temperature": 0.0, "max_tokens": 3}
BIG = "9" * 60

# (line, id of its answer, error type or None when served, words its message must hold)
HOSTILE = [
    (b'{"id": "ok1", "prompt": "Open the file"}', "ok1", None, []),
    (b"[" * 1000 + b"]" * 1000, 2, "invalid_json", ["deeper than 32"]),
    (b'{"id": "deepmsg", "messages": ' + b"[" * 40 + b"]" * 40 + b"}", 3, "invalid_json", ["deeper than 32"]),
    (b'{"id": "bigint", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 4, "invalid_json",
     ["an integer of 5,000 digits (at most 4,300"]),
    (b'{"id": "n", "prompt": "x", "n": 1000000000}', "n", "invalid_request", ["n=1000000000", "at most"]),
    (b'{"id": "nf", "prompt": "x", "n": 1e9}', "nf", "invalid_request", ["n must be an integer"]),
    (b'{"id": "stopd", "prompt": "x", "stop": {"a": 1}}', "stopd", "invalid_request", ["stop must be a list"]),
    (b'{"id": "stopi", "prompt": "x", "stop_token_ids": 5}', "stopi", "invalid_request",
     ["stop_token_ids must be a list"]),
    (b'{"id": "stops", "prompt": "x", "stop_token_ids": "12"}', "stops", "invalid_request",
     ["stop_token_ids must be a list"]),
    (b'{"id": "stopv", "prompt": "x", "stop_token_ids": [99999]}', "stopv", "invalid_request",
     ["stop_token_ids [99999]", "vocabulary"]),
    (b'{"id": "temp", "prompt": "x", "temperature": 1e308}', "temp", "invalid_request", ["at most 10000"]),
    (b'{"id": "topk", "prompt": "x", "top_k": ' + BIG.encode() + b"}", "topk", "invalid_request", ["top_k"]),
    (b'{"id": "rep", "prompt": "x", "repetition_penalty": 1e-300}', "rep", "invalid_request",
     ["repetition_penalty"]),
    (b'{"id": "mt", "prompt": "x", "max_tokens": ' + BIG.encode() + b"}", "mt", "invalid_request",
     ["max_model_len"]),
    (b'{"id": "lp", "prompt": "x", "logprobs": 100}', "lp", "invalid_request", ["logprobs"]),
    (b'{"id": "ids", "prompt_token_ids": [1, ' + BIG.encode() + b"]}", "ids", "invalid_request", ["vocabulary"]),
    (b'{"id": "many", "prompt": "x", ' + b", ".join(b'"k%d": 1' % i for i in range(3000)) + b"}", "many",
     "invalid_request", ["and 2995 more"]),
    (b'{"id": ' + b'"' + b"i" * 10000 + b'", "prompt": 5}', "i" * 10000, "invalid_request", ["prompt must be"]),
    (b'{"id": "seed", "prompt": "x", "seed": ' + BIG.encode() + b"}", "seed", None, []),
    (b'{"id": "sur", "prompt": "a\\ud800b"}', "sur", "invalid_request", ["prompt holds a lone UTF-16 surrogate"]),
    (b'{"id": "surm", "messages": [{"role": "user", "content": "\\udfff"}]}', "surm", "invalid_request",
     ["messages[0].content holds a lone UTF-16 surrogate"]),
    (b'{"id": "surs", "prompt": "x", "stop": ["\\ud800"]}', "surs", "invalid_request", ["stop strings", "surrogate"]),
    (b'{"id": "stopn", "prompt": "x", "stop": [' + b", ".join(b'"s%d"' % i for i in range(33)) + b"]}", "stopn",
     "invalid_request", ["stop has 33 strings; at most 32"]),
    (b'{"id": "stopl", "prompt": "x", "stop": ["' + b"s" * 300 + b'"]}', "stopl", "invalid_request",
     ["300 characters; at most 256"]),
    (b'{"id": "ok2", "prompt_token_ids": [5, 6, 7]}', "ok2", None, []),
]


def check_answers(got: list[dict]) -> None:
    assert [a["id"] for a in got] == [case[1] for case in HOSTILE]
    for answer, (_, rid, kind, words) in zip(got, HOSTILE):
        if kind is None:
            assert "error" not in answer and len(answer["token_ids"]) == 3, answer
            continue
        assert answer["error"]["type"] == kind, answer
        for word in words:
            assert word in answer["error"]["message"], (word, answer)
        assert len(answer["error"]["message"]) < 600 and "sys." not in answer["error"]["message"]


@pytest.fixture(scope="module")
def llm():
    from minillm import LLM
    return LLM(device="cpu", max_num_seqs=8, max_model_len=128, num_kv_blocks=64)


def test_generate_answers_every_hostile_line_in_order(llm):
    out = io.BytesIO()
    summary = run_generate(llm, list(enumerate((case[0] for case in HOSTILE), 1)), DEFAULTS, out, progress=False)
    check_answers([json.loads(line) for line in out.getvalue().splitlines()])
    assert summary.exit_code == 1 and not llm.has_unfinished_requests()


def test_serve_stdin_gives_every_hostile_line_one_final_event(llm):
    out = io.BytesIO()
    server = StdinServer(llm, DEFAULTS, out)
    assert server.serve(io.BytesIO(b"\n".join(case[0] for case in HOSTILE) + b"\n")) == 0
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    finals = [e for e in events if e["event"] in ("done", "error")]
    assert sorted(map(str, (e["id"] for e in finals))) == sorted(str(case[1]) for case in HOSTILE)
    served = {e["id"] for e in finals if e["event"] == "done"}
    assert served == {case[1] for case in HOSTILE if case[2] is None}


# ---------------------------------------------------------------- the process: SIGTERM, a closed stdout

def minillm(*args, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # bufsize=0: a readline() must not buffer lines past the first, which communicate() (reading the descriptor
    # itself) would then never see
    return subprocess.Popen([sys.executable, "-m", "minillm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, bufsize=0, **kw)


@pytest.mark.slow
def test_sigterm_in_generate_answers_every_line_then_exits_143(tmp_path):
    long = [json.dumps({"id": f"long{i}", "prompt": "Open", "max_tokens": 1000, "ignore_eos": True}).encode()
            for i in range(2)]
    lines = [HOSTILE[0][0], HOSTILE[1][0], *long, HOSTILE[4][0], HOSTILE[-1][0]]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    proc = minillm("generate", path, "--device", "cpu", "--set", "sampling.max_tokens=3", "--no-progress")
    try:
        first = proc.stdout.readline()         # the first line is answered: the long ones are running
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    got = [json.loads(line) for line in (first + rest).splitlines()]
    assert proc.returncode == 143, err.decode()
    assert [a["id"] for a in got] == ["ok1", 2, "long0", "long1", "n", "ok2"]
    assert [a.get("finish_reason") for a in got[2:4]] == ["abort", "abort"]
    assert all(len(a["token_ids"]) < 1000 for a in got[2:4])
    assert "stopped by SIGTERM" in err.decode() and "Traceback" not in err.decode()


@pytest.mark.slow
def test_closed_stdout_ends_quietly():
    proc = minillm("generate", "-", "--device", "cpu", "--no-progress", "--set", "sampling.max_tokens=8",
                   stdin=subprocess.PIPE)
    lines = b"".join(json.dumps({"id": i, "prompt": "Open the file"}).encode() + b"\n" for i in range(400))
    proc.stdin.write(lines)
    proc.stdin.close()
    assert json.loads(proc.stdout.readline())["id"] == 0
    proc.stdout.close()                       # what `| head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == ""
