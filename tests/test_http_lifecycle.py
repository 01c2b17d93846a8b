"""`minillm serve` under load and at its edges: the API key, clients that disconnect (their requests aborted and
their KV blocks freed, seen through /metrics), 48 concurrent streams, and SIGTERM (drain, then exit 0).

One server (with an API key and a 2 s drain) serves the module; the SIGTERM test ends it, so it runs last.
"""
import asyncio
import threading
import time

import httpx
import openai
import pytest

from http_server import ServerProcess

MODEL = "minillm-demo"
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ABORTED = 'minillm_requests_finished_total{finish_reason="abort"}'
DRAIN_S = 2.0


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY, "--drain-timeout", str(DRAIN_S))
    yield srv
    srv.stop()


def _long_stream_body(max_tokens: int = 1500) -> dict:
    return {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def _wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_api_key_is_enforced_on_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.base_url + "/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/models").status_code == 401
    assert httpx.get(server.base_url + "/nothing").status_code == 401   # no route discovery without the key
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_disconnect_mid_stream_aborts_and_frees_the_request(server):
    aborted = server.metrics().get(ABORTED, 0.0)
    with httpx.stream("POST", server.base_url + "/completions", json=_long_stream_body(), headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data: "):
                pass
        assert server.metrics()["minillm_requests_running"] == 1
    # the connection is closed: the request must end now, not after its 1,500 tokens
    assert _wait_for(lambda: server.metrics().get(ABORTED, 0.0) == aborted + 1)
    # The gauges follow the engine's next stats report (from the engine-core process, just after the abort's
    # output): wait for them too, within the same bound.
    assert _wait_for(lambda: (m := server.metrics())["minillm_requests_running"] == 0
                     and m["minillm_kv_cache_usage"] == 0.0)
    m = server.metrics()
    generated = m["minillm_generation_tokens_total"]
    time.sleep(0.3)
    assert server.metrics()["minillm_generation_tokens_total"] == generated   # nothing decodes for it any more


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(server):
    aborted = server.metrics().get(ABORTED, 0.0)
    body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.5))
    assert _wait_for(lambda: server.metrics().get(ABORTED, 0.0) == aborted + 1)
    assert server.metrics()["minillm_requests_running"] == 0


def test_48_concurrent_streams_all_finish(server):
    async def one(client, i: int):
        stream = await client.completions.create(model=MODEL, prompt=f"Request {i}:", max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices]

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
        results = await asyncio.gather(*(one(client, i) for i in range(48)))
        await client.close()
        return results

    results = asyncio.run(main())
    assert len(results) == 48
    for tokens, finishes in results:
        assert tokens == 12 and finishes[-1] == "length" and finishes.count("length") == 1
    m = server.metrics()
    assert m["minillm_requests_running"] == 0 and m["minillm_requests_waiting"] == 0
    assert m["minillm_time_to_first_token_seconds_count"] >= 48


def test_sigterm_drains_then_exits_0(server):
    """A short stream finishes within the drain; a long one is aborted at the deadline and still ends with its
    final chunk and [DONE]; no new connection is accepted; the process exits 0."""
    results = {}

    def stream(name: str, max_tokens: int) -> None:
        events = []
        with httpx.stream("POST", server.base_url + "/completions", json=_long_stream_body(max_tokens),
                          headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    results.setdefault(name + "_started", time.monotonic())
        results[name] = events

    # on any CPU the long one (2,000 tokens) outlasts the drain, and the short one (4 tokens) does not
    threads = [threading.Thread(target=stream, args=("short", 4)), threading.Thread(target=stream,
                                                                                     args=("long", 2000))]
    for t in threads:
        t.start()
    assert _wait_for(lambda: "short_started" in results and "long_started" in results)
    t0 = time.monotonic()
    server.proc.send_signal(15)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
    assert server.proc.wait(timeout=DRAIN_S + 20) == 0
    assert time.monotonic() - t0 < DRAIN_S + 10
    for t in threads:
        t.join(10)
    for name, reason in (("short", '"length"'), ("long", '"abort"')):
        events = results[name]
        assert events[-1] == "data: [DONE]"
        assert f'"finish_reason":{reason}' in events[-2]
