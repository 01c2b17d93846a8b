"""serve-stdin: requests arriving over time, streamed events, abort, EOF mid-stream, SIGINT and SIGTERM.

The subprocess tests drive `python -m minillm serve-stdin` exactly as a client would; the in-process tests feed
lines straight to StdinServer for deterministic ordering.
"""
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from minillm.serve.stdin_server import StdinServer

ENGINE_ARGS = ["--device", "cpu", "--set", "cache.num_kv_blocks=128", "--set", "sampling.temperature=0"]
FINAL = ("done", "error")


class Server:
    """A serve-stdin subprocess; a thread collects its stdout events so the test can wait for one."""

    def __init__(self, model: Path):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve-stdin", "--model", str(model),
                                      *ENGINE_ARGS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def send(self, obj) -> None:
        self.proc.stdin.write((obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n")
        self.proc.stdin.flush()

    def wait_for(self, rid, event: str, timeout: float = 60.0) -> dict:
        while True:
            ev = self.events.get(timeout=timeout)
            self.seen.append(ev)
            if ev["id"] == rid and ev["event"] == event:
                return ev

    def finish(self, timeout: float = 60.0) -> tuple[int, list[dict]]:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout)          # stdout reaches EOF once the process is gone
        while not self.events.empty():
            self.seen.append(self.events.get())
        return code, self.seen


def finals_by_id(events: list[dict]) -> dict:
    finals = defaultdict(list)
    for ev in events:
        if ev["event"] in FINAL:
            finals[ev["id"]].append(ev)
    return finals


def test_requests_over_time_abort_and_eof_mid_stream(tiny_model):
    srv = Server(tiny_model)
    try:
        srv.send({"id": "A", "prompt": "The function", "max_tokens": 400, "ignore_eos": True})
        srv.wait_for("A", "token")
        srv.send({"id": "B", "prompt_token_ids": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
        srv.send({"id": "C", "prompt": "Return a list", "max_tokens": 300, "ignore_eos": True})
        srv.send(b'{"id": "bad", "prompt": 1}')
        srv.send(b"not json")
        srv.send({"abort": "A"})
        srv.wait_for("A", "done")
        srv.wait_for("C", "token")
        srv.proc.stdin.close()            # EOF while C is still generating: it must finish, not vanish
        code, events = srv.finish()
    finally:
        srv.proc.kill()
    assert code == 0, srv.proc.stderr.read().decode()
    finals = finals_by_id(events)
    assert {k: len(v) for k, v in finals.items()} == {"A": 1, "B": 1, "C": 1, "bad": 1, 5: 1}
    assert finals["A"][0]["finish_reason"] == "abort" and finals["A"][0]["usage"]["completion_tokens"] < 400
    assert finals["B"][0]["finish_reason"] == "length" and finals["B"][0]["usage"]["completion_tokens"] == 4
    assert finals["C"][0]["finish_reason"] == "length" and finals["C"][0]["usage"]["completion_tokens"] == 300
    assert finals["bad"][0]["error"]["type"] == "invalid_request"
    assert finals[5][0]["error"]["type"] == "invalid_json"
    for rid in ("B", "C"):
        tokens = [t for ev in events if ev["id"] == rid and ev["event"] == "token" for t in ev["token_ids"]]
        assert len(tokens) == finals[rid][0]["usage"]["completion_tokens"]
        metrics = finals[rid][0]["metrics"]
        assert metrics["ttft_s"] > 0 and len(metrics["itl_s"]) == len(tokens) - 1
    # Nothing streams for a request after its final event.
    last_final = {ev["id"]: i for i, ev in enumerate(events) if ev["event"] in FINAL}
    assert all(i < last_final[ev["id"]] for i, ev in enumerate(events) if ev["event"] == "token")


@pytest.mark.parametrize("sig, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_aborts_everything_with_final_events(tiny_model, sig, exit_code):
    srv = Server(tiny_model)
    try:
        srv.send({"id": "long", "prompt": "The function", "max_tokens": 450, "ignore_eos": True})
        srv.send({"id": "other", "prompt": "Return", "max_tokens": 450, "ignore_eos": True})
        srv.wait_for("long", "token")
        srv.proc.send_signal(sig)
        code, events = srv.finish()
    finally:
        srv.proc.kill()
    assert code == exit_code
    finals = finals_by_id(events)
    assert {k: [e["finish_reason"] for e in v] for k, v in finals.items()} == {"long": ["abort"],
                                                                             "other": ["abort"]}


# ---------------------------------------------------------------- in process: deterministic ordering

@pytest.fixture(scope="module")
def llm(tiny_model):
    from minillm import LLM
    return LLM(str(tiny_model), device="cpu", num_kv_blocks=128)


def serve_lines(llm, lines: list[bytes]) -> list[dict]:
    """Admit `lines` in order before any step, then run to EOF."""
    out = io.BytesIO()
    server = StdinServer(llm, {"temperature": 0.0, "max_tokens": 4}, out)
    for n, raw in enumerate(lines, 1):
        server._handle(n, raw)
    assert server.serve(io.BytesIO(b"")) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_duplicate_id_in_flight_and_unknown_abort(llm):
    events = serve_lines(llm, [b'{"id": "d", "prompt": "a", "max_tokens": 8, "ignore_eos": true}',
                               b'{"id": "d", "prompt": "b"}',
                               b'{"abort": "nobody"}',
                               b'', b'{"id": 9, "prompt_token_ids": [1, 2]}'])
    finals = finals_by_id(events)
    assert {k: [e["event"] for e in v] for k, v in finals.items()} == {"d": ["error", "done"],
                                                                      "nobody": ["error"], 9: ["done"]}
    assert "already in flight" in finals["d"][0]["error"]["message"]
    assert finals["nobody"][0]["error"]["type"] == "unknown_id"


def test_greedy_stream_matches_generate(llm):
    from minillm import SamplingParams
    events = serve_lines(llm, [b'{"id": "g", "prompt": "The value", "max_tokens": 12, "ignore_eos": true}'])
    streamed = [t for ev in events if ev["event"] == "token" for t in ev["token_ids"]]
    text = "".join(ev["text"] for ev in events if ev["event"] == "token")
    ref = llm.generate(["The value"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert streamed == ref.token_ids and text == ref.text


def test_n_completions_are_indexed(llm):
    events = serve_lines(llm, [b'{"id": "n", "prompt": "x", "n": 2, "temperature": 1.0, "seed": 3, '
                               b'"max_tokens": 3, "ignore_eos": true}'])
    assert {ev["index"] for ev in events if ev["event"] == "token"} == {0, 1}
    (done,) = [ev for ev in events if ev["event"] == "done"]
    assert done["usage"]["completion_tokens"] == 6 and [o["index"] for o in done["outputs"]] == [0, 1]


class FailingOnce:
    """The real engine, except that its second step() raises, as a device error would."""

    def __init__(self, llm):
        self.llm, self.calls = llm, 0

    def step(self):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("device lost")
        return self.llm.step()

    def __getattr__(self, name):
        return getattr(self.llm, name)


def test_failed_step_ends_inflight_requests_with_one_error_each(llm):
    out = io.BytesIO()
    server = StdinServer(FailingOnce(llm), {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}, out)
    server._handle(1, b'{"id": "x", "prompt": "a"}')
    server._handle(2, b'{"id": "y", "prompt": "b"}')
    assert server.serve(io.BytesIO(b"")) == 0
    finals = finals_by_id([json.loads(line) for line in out.getvalue().splitlines()])
    assert {k: [(e["event"], e["error"]["type"]) for e in v] for k, v in finals.items()} == {
        "x": [("error", "engine_error")], "y": [("error", "engine_error")]}
    assert "device lost" in finals["x"][0]["error"]["message"]
    assert not llm.has_unfinished_requests()
    # The engine keeps serving afterwards.
    assert [e["event"] for e in serve_lines(llm, [b'{"id": "z", "prompt": "c"}'])][-1] == "done"


def test_failed_step_in_generate_answers_every_line(llm):
    from minillm.serve.generate_jsonl import run_generate
    out = io.BytesIO()
    lines = [(1, b'{"prompt": "a", "max_tokens": 6, "ignore_eos": true}'), (2, b'{"prompt": ""}'),
             (3, b'{"prompt": "b", "max_tokens": 6, "ignore_eos": true}')]
    summary = run_generate(FailingOnce(llm), lines, {"temperature": 0.0}, out, progress=False)
    got = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(a["id"], a["error"]["type"]) for a in got] == [(1, "engine_error"), (2, "invalid_request"),
                                                            (3, "engine_error")]
    assert (summary.failed, summary.exit_code) == (3, 1)
    while llm.has_unfinished_requests():   # the aborts are reported on the next step: leave the engine empty
        llm.step()
