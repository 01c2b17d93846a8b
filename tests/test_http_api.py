"""`minillm serve` driven by the official openai client (sync and async): completions and chat, streamed and
whole, n > 1, logprobs, stop strings, token-id prompts and minillm's extras through extra_body.

One server subprocess (the demo model, CPU) serves the whole module.
"""
import asyncio
import json

import httpx
import openai
import pytest

from http_server import ServerProcess

MODEL = "minillm-demo"
PROMPT = "The function"
CHAT = [{"role": "user", "content": "What does os.path.join do?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _stream_text(chunks, index: int = 0) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)


def test_models_lists_the_served_model_with_its_max_model_len(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 2048
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_streamed_equals_whole_at_temperature_0(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = whole.choices[0].text
    assert text and _stream_text(chunks) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_equals_whole_at_temperature_0(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text and text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)   # no include_usage: no usage chunk


def test_sse_wire_format_ends_with_done(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1


def test_async_client_completion_and_chat(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        whole = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                                       stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await aclient.close()
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert whole.choices[0].text and whole.usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_n_completions_whole_and_streamed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=3)
    whole = client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in whole.choices)
    chunks = list(client.completions.create(**kw, stream=True))
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1, 2]
    for c in whole.choices:   # seeded: each completion reproduces, streamed or not
        assert _stream_text(chunks, c.index) == c.text
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in client.completions.create(
        **kw, extra_body={"return_token_ids": True}).choices)


def test_prompt_lists_give_choices_in_prompt_order(client):
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
              for p in ("a b", PROMPT)]
    both = client.completions.create(model=MODEL, prompt=["a b", PROMPT], max_tokens=6, temperature=0, n=2)
    by_index = {c.index: c.text for c in both.choices}
    assert by_index == {0: single[0], 1: single[0], 2: single[1], 3: single[1]}


def test_token_id_prompts(client):
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0]
    ids = first.prompt_token_ids
    assert ids and all(isinstance(t, int) for t in ids)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.text and again.usage.prompt_tokens == len(ids)
    two = client.completions.create(model=MODEL, prompt=[ids, [5, 6, 7]], max_tokens=3, temperature=0)
    assert two.usage.prompt_tokens == len(ids) + 3 and len(two.choices) == 2


def test_completion_logprobs_whole_and_streamed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    whole = client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == whole.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(abs(x - max(top.values())) < 1e-4 for x, top in zip(lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    # each chunk carries its own tokens' logprobs, not all of them at the end
    assert sum(1 for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.tokens) > 1


def test_chat_logprobs_with_top_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)


def test_stop_string_is_never_shown(client):
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    ref = client.completions.create(max_tokens=40, **kw).choices[0].text
    k = len(ref) // 2
    stop = ref[k:k + 3]
    expected = ref[:ref.index(stop)]
    out = client.completions.create(max_tokens=40, stop=[stop], **kw).choices[0]
    assert out.text == expected and out.finish_reason == "stop"
    chunks = list(client.completions.create(max_tokens=40, stop=stop, stream=True, **kw))
    assert _stream_text(chunks) == expected
    assert not any(stop in c.choices[0].text for c in chunks)


def test_extras_through_extra_body(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10)
    full = client.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                      "min_tokens": 10}).choices[0]
    assert len(full.token_ids) == 10 and full.finish_reason == "length"
    stop_id = full.token_ids[3]
    cut = client.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                     "stop_token_ids": [stop_id]}).choices[0]
    assert cut.finish_reason == "stop" and full.token_ids[:len(cut.token_ids)] == cut.token_ids
    assert len(cut.token_ids) <= 4
    top1 = client.completions.create(**kw, temperature=1.0, extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].text == full.text    # top_k=1 is greedy at any temperature
    ok = client.completions.create(**kw, extra_body={"min_p": 0.1, "repetition_penalty": 1.2, "priority": 1})
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_chat_template_kwargs_reach_the_template(client):
    on = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on.usage.prompt_tokens >= 1 and off.usage.prompt_tokens >= 1


def test_usage_counts_prefix_cache_hits(client):
    ids = list(range(100, 150))   # 50 tokens: 3 full blocks of 16
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 48


def test_seeded_sampling_reproduces(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
