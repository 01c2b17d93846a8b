"""Structured outputs and tool calling through `minillm serve`, driven by the official openai client (the demo
model on the CPU, one server for the module): response_format json_object / json_schema, structured_outputs
regex / choice / grammar, tools with each tool_choice, streamed and whole, n = 3, seeded repeats, and bad input.

Each constraint is also sent without the constraint (same seed), and that output is shown not to satisfy it: the
constraint, not the model, does the work.
"""
import json
import re

import httpx
import jsonschema
import openai
import pytest

from http_server import ServerProcess

MODEL = "minillm-demo"
CHAT = [{"role": "user", "content": "Give me the data."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tag": {"enum": ["x", "y"]}}, "required": ["name", "n", "tag"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Oslo", "Paris"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# 60 properties compile to ~200 kB, over this server's max_grammar_bytes; every other grammar here is < 60 kB.
HUGE = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 40} for i in range(60)},
        "required": [f"k{i}" for i in range(60)]}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--set", "structured.max_grammar_bytes=100000")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", CHAT), temperature=1.0, **kw)


def _parses(text: str, schema=None) -> bool:
    try:
        value = json.loads(text)
        if schema is not None:
            jsonschema.validate(value, schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_json_schema_whole_and_streamed(client):
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    whole = _chat(client, response_format=rf, n=3, seed=1, max_tokens=60)
    assert [c.finish_reason for c in whole.choices] == ["stop"] * 3
    for c in whole.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    chunks = list(_chat(client, response_format=rf, n=3, seed=1, max_tokens=60, stream=True))
    streamed = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
                for i in range(3)]
    assert streamed == [c.message.content for c in whole.choices]
    free = _chat(client, n=3, seed=1, max_tokens=60)
    assert not any(_parses(c.message.content, SCHEMA) for c in free.choices)


def test_json_object_outputs_that_stop_parse(client):
    prompt = 'Return {} or {"k": 1}:'
    out = client.completions.create(model=MODEL, prompt=prompt, n=4, seed=0, max_tokens=48, temperature=1.0,
                                    extra_body={"response_format": {"type": "json_object"}})
    stopped = [c.text for c in out.choices if c.finish_reason == "stop"]
    assert stopped, [c.text for c in out.choices]
    assert all(isinstance(json.loads(t), dict) for t in stopped)
    assert all(c.text.startswith("{") for c in out.choices)
    free = client.completions.create(model=MODEL, prompt=prompt, n=4, seed=0, max_tokens=48, temperature=1.0)
    assert not any(_parses(c.text) for c in free.choices)


def test_regex_on_completions(client):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    out = client.completions.create(model=MODEL, prompt="Code:", n=3, seed=5, max_tokens=20, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in out.choices)
    free = client.completions.create(model=MODEL, prompt="Code:", n=3, seed=5, max_tokens=20, temperature=1.0)
    assert not any(re.fullmatch(pattern, c.text) for c in free.choices)


def test_choice_with_seeded_repeats(client):
    choices = ["red", "green", "blue"]
    body = {"structured_outputs": {"choice": choices}}
    first = _chat(client, n=3, seed=11, max_tokens=10, extra_body=body)
    again = _chat(client, n=3, seed=11, max_tokens=10, extra_body=body)
    assert all(c.message.content in choices for c in first.choices)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    free = _chat(client, n=3, seed=11, max_tokens=10)
    assert not any(c.message.content in choices for c in free.choices)


def test_ebnf_grammar(client):
    grammar = 'root ::= "SELECT " col (", " col)? " FROM t"\ncol ::= "a" | "b" | "c"'
    out = _chat(client, seed=2, max_tokens=30, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"SELECT [abc](, [abc])? FROM t", out.choices[0].message.content)
    free = _chat(client, seed=2, max_tokens=30)
    assert not re.fullmatch(r"SELECT [abc](, [abc])? FROM t", free.choices[0].message.content)


def _check_call(call, names):
    assert call.type == "function" and call.id and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_required_and_none(client):
    out = _chat(client, tools=TOOLS, tool_choice="required", seed=3, max_tokens=100)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], {"get_weather", "get_time"})
    free = _chat(client, tools=TOOLS, tool_choice="none", seed=3, max_tokens=100)
    assert not free.choices[0].message.tool_calls and free.choices[0].finish_reason != "tool_calls"


def test_named_tool_choice_streamed_equals_whole(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = _chat(client, tools=TOOLS, tool_choice=named, seed=4, max_tokens=100)
    call = whole.choices[0].message.tool_calls[0]
    _check_call(call, {"get_time"})
    chunks = list(_chat(client, tools=TOOLS, tool_choice=named, seed=4, max_tokens=100, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id
    assert (deltas[0].function.name, deltas[0].function.arguments) == (call.function.name, call.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_auto_parses_calls_out_of_the_text(client):
    # The demo model never writes a call on its own: a grammar makes it write one, and tool_choice auto must turn
    # that text into tool_calls (with tool_choice none the same text stays content).
    call = '<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Oslo\\", \\"days\\": 2}}'
    grammar = f'root ::= "Sure.\\n{call}\\n</tool_call>"'
    body = {"structured_outputs": {"grammar": grammar}}
    auto = _chat(client, tools=TOOLS, tool_choice="auto", seed=1, max_tokens=200, extra_body=body).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in auto.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})]
    none = _chat(client, tools=TOOLS, tool_choice="none", seed=1, max_tokens=200, extra_body=body).choices[0]
    assert none.message.tool_calls is None and "<tool_call>" in none.message.content


def test_history_with_tool_calls_and_tool_results(client):
    history = [*CHAT,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    out = _chat(client, messages=history, tools=TOOLS, seed=1, max_tokens=5)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


C, CH = "/v1/completions", "/v1/chat/completions"
BAD = [
    ("invalid JSON schema", CH, {"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ("unknown response_format type", CH, {"response_format": {"type": "xml"}}, "response_format"),
    ("unbalanced regex", C, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ("empty choice list", C, {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("grammar that does not parse", CH, {"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs"),
    ("tool_choice naming an unknown function", CH,
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("tool_choice required without tools", CH, {"tool_choice": "required"}, "tool_choice"),
    ("tool with a bad parameters schema", CH,
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, "tools"),
    ("schema over the compiled-size bound", CH,
     {"response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": HUGE}}}, "response_format"),
    ("ignore_eos with a constraint", C, {"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize("name,path,extra,param", BAD, ids=[b[0] for b in BAD])
def test_bad_structured_input_is_a_400_naming_the_param(server, name, path, extra, param):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"messages": CHAT} if path == CH else {"prompt": "x"})
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(server.url + C, json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200   # the server keeps serving
