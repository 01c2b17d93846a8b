"""Bad input to `minillm serve`: each gets an OpenAI-shaped error with the right status (400 naming the field,
never FastAPI's 422; 404; 405; 413; 503 with Retry-After), and the server keeps serving afterwards.

The server runs one request at a time, with a small body limit and a waiting bound of 2, so the 413 and the 503
can be reached with a few requests.
"""
import asyncio
import json

import httpx
import openai
import pytest

from http_server import ServerProcess

MODEL = "minillm-demo"
MAX_BODY = 65536
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-body-bytes", str(MAX_BODY), "--max-waiting", "2", "--set", "scheduler.max_num_seqs=1")
    yield srv
    srv.stop()


C, CH = "/v1/completions", "/v1/chat/completions"

# (name, path, body: dict or raw bytes, status, param)
BAD = [
    ("malformed JSON", C, b'{"prompt": "x",', 400, None),
    ("body is a JSON array", C, b"[1, 2]", 400, None),
    ("empty body", C, b"", 400, None),
    ("NaN is not JSON", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("missing prompt", C, {}, 400, "prompt"),
    ("unknown field", C, {"prompt": "x", "foo": 1}, 400, "foo"),
    ("string for a number", C, {"prompt": "x", "temperature": "1"}, 400, "temperature"),
    ("float for an integer", C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("bool for an integer", C, {"prompt": "x", "n": True}, 400, "n"),
    ("max_tokens 0", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("negative temperature", C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p 0", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above 1", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", C, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("n 0", C, {"prompt": "x", "n": 0}, 400, "n"),
    ("logprobs 21", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("n beyond max_num_seqs", C, {"prompt": "x", "n": 100000}, 400, "n"),
    ("stop id outside the vocabulary", C, {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("presence_penalty 3", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("min_tokens over max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("stop of the wrong type", C, {"prompt": "x", "stop": 3}, 400, "stop"),
    ("empty stop string", C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("empty prompt string", C, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", C, {"prompt": []}, 400, "prompt"),
    ("mixed prompt list", C, {"prompt": [1, "a"]}, 400, "prompt"),
    ("token id outside the vocabulary", C, {"prompt": [1, 99999]}, 400, "prompt"),
    ("negative token id", C, {"prompt": [1, -1]}, 400, "prompt"),
    ("prompt + max_tokens over max_model_len", C, {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("prompt alone over max_model_len", C, {"prompt": list(range(2100))}, 400, "prompt"),
    ("unknown model", C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("echo (unsupported)", C, {"prompt": "x", "echo": True}, 400, "echo"),
    ("best_of (unsupported)", C, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("logit_bias (unsupported)", C, {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("stream_options without stream", C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("missing messages", CH, {}, 400, "messages"),
    ("empty messages", CH, {"messages": []}, 400, "messages"),
    ("unknown role", CH, {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages"),
    ("message without content", CH, {"messages": [{"role": "user"}]}, 400, "messages"),
    ("image content part", CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ("tool_calls in a message", CH, {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]}, 400,
     "messages"),
    ("top_logprobs without logprobs", CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs 21", CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("max_completion_tokens 0", CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("unknown chat_template_kwargs key", CH, {"messages": MSG, "chat_template_kwargs": {"foo": 1}}, 400,
     "chat_template_kwargs"),
    ("tools without a function", CH, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("response_format of an unknown type", CH, {"messages": MSG, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, None),
]


def _post(server, path, body, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def _check_error(r, status: int, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server, name, path, body, status, param):
    err = _check_error(_post(server, path, body), status, param)
    if param is not None:
        assert param in err["message"]


def test_server_still_serves_after_bad_input(server):
    for _, path, body, _, _ in BAD:
        _post(server, path, body)
    r = _post(server, C, {"prompt": "The function", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_wrong_method_and_unknown_get_route(server):
    _check_error(httpx.get(server.url + C), 405, None)
    _check_error(httpx.get(server.url + "/nothing"), 404, None)
    _check_error(httpx.get(server.url + "/v1/models/gpt-4"), 404, "model")


def test_body_over_the_limit_is_413(server):
    r = _post(server, C, {"prompt": "x" * (MAX_BODY + 10)})
    assert _check_error(r, 413, None)["code"] == "request_too_large"
    chunked = httpx.post(server.url + C, content=iter([b'{"prompt": "', b"y" * MAX_BODY, b'"}']), timeout=60,
                         headers={"Content-Type": "application/json"})   # no Content-Length: counted as it arrives
    _check_error(chunked, 413, None)


def test_openai_client_sees_the_statuses(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSG, stream=True, max_tokens=5000)


def test_waiting_queue_over_its_bound_is_503_with_retry_after(server):
    """One request runs (max_num_seqs=1), two wait (the bound): the next gets 503; once the running one is gone
    the waiting two are served."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            async with client.stream("POST", C, json=body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                waiting = [asyncio.create_task(client.post(C, json={"prompt": "y", "max_tokens": 2}))
                           for _ in range(2)]
                for _ in range(200):
                    if server.metrics()["minillm_requests_waiting"] >= 2:
                        break
                    await asyncio.sleep(0.02)
                refused = await client.post(C, json={"prompt": "z", "max_tokens": 2})
            # leaving the stream's block closed the connection: the running request is aborted
            served = await asyncio.gather(*waiting)
            return refused, served

    refused, served = asyncio.run(main())
    assert _check_error(refused, 503, None)["code"] == "overloaded"
    assert refused.headers["Retry-After"] == "1"
    assert [r.status_code for r in served] == [200, 200]
