"""Hostile requests to the HTTP server, run in this process (uvicorn on a thread, the demo model): text that is
not Unicode, too many sequences or stop strings, prompts too long by themselves, a client trickling its headers.
Each is refused naming the field or closed, and the server keeps serving."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from minillm.serve.http.app import create_app
from minillm.serve.http.server_config import uvicorn_config
from minillm.serve.http.settings import ServerSettings

HEADER_TIMEOUT_S = 1.0
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def url():
    from minillm import LLM
    llm = LLM(device="cpu", max_num_seqs=8, max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)
    settings = ServerSettings("minillm-demo", max_waiting=8, header_timeout_s=HEADER_TIMEOUT_S)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(create_app(llm, {"temperature": 0.0, "max_tokens": 2}, settings),
                                           settings, "warning", graceful_shutdown_s=1.0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield base
    server.should_exit = True
    thread.join(30)


def _post(url, path, body: bytes | dict):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def _error(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize("path, body, param, words", [
    (C, b'{"prompt": "a\\ud800b"}', "prompt", "prompt holds a lone UTF-16 surrogate"),
    (CH, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages",
     "messages[0].content holds a lone UTF-16 surrogate"),
    (C, b'{"prompt": "x", "stop": ["\\ud800"]}', "stop", "surrogate"),
    (C, {"prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}, "stop", "stop has 100,000 strings; at most 32"),
    (C, {"prompt": "x", "stop": ["s" * 300]}, "stop", "300 characters; at most 256"),
    (C, {"prompt": ["x"] * 40, "n": 8}, "prompt", "320 sequences (prompts x n), more than the 8"),
    (CH, {"messages": [{"role": "user", "content": "x"}], "n": 9}, "n", "9 sequences"),
    (C, {"prompt": list(range(200)), "max_tokens": 5}, "prompt", "prompt is 200 tokens; max_model_len (128)"),
    (C, {"prompt": "x" * 1_000_000, "max_tokens": 5}, "prompt", "1,000,000 characters: more than max_model_len"),
])
def test_hostile_body_is_a_400_naming_the_field(url, path, body, param, words):
    assert words in _error(_post(url, path, body), param)
    assert _post(url, C, {"prompt": "Open the file"}).status_code == 200


def test_sequences_up_to_the_waiting_bound_are_served(url):
    r = _post(url, C, {"prompt": ["a", "b", "c", "d"], "n": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8


def test_a_connection_trickling_its_headers_is_closed(url):
    """One header byte every 0.2 s: closed within the header timeout (plus slack), while /health answers."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start, closed = time.monotonic(), False
        while time.monotonic() - start < HEADER_TIMEOUT_S + 5:
            try:
                sock.sendall(b"X")
                sock.settimeout(0.2)
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:   # reset or broken pipe: closed as well
                closed = True
                break
        took = time.monotonic() - start
    assert closed and took < HEADER_TIMEOUT_S + 3, took
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_slow_but_complete_request_is_served(url):
    """Headers inside the deadline, then a body: the deadline no longer applies."""
    port = int(url.rsplit(":", 1)[1])
    body = b'{"prompt": "Open", "max_tokens": 2}'
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        sock.sendall(body)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")


def test_health_answers_while_a_prompt_is_being_prepared(url):
    """Preparing a prompt (tokenizing, rendering) runs off the event loop: a prepare that takes 2 s (slowed here
    on purpose) leaves /health answering at once."""
    from minillm.llm import LLM
    original = LLM.prepare_prompt

    def slow(self, *args, **kw):
        time.sleep(2.0)
        return original(self, *args, **kw)

    LLM.prepare_prompt = slow
    try:
        pending = threading.Thread(target=_post, args=(url, C, {"prompt": "Open"}))
        pending.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        took = time.monotonic() - start
        pending.join(30)
    finally:
        LLM.prepare_prompt = original
    assert took < 1.5, took
