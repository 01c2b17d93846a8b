"""Structured outputs inside the engine (the demo model on the CPU): the bitmask op against a plain loop, spec
checks, compile bounds, tool-call parsing, and constrained generation with n > 1, seeds, async vs synchronous
steps, preemption, prefix hits, min_tokens and a hypothesis property over random schemas."""
import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from minillm.config import StructuredConfig
from minillm.llm import LLM
from minillm.sampling.grammar_mask import GrammarMask, apply_grammar_mask
from minillm.sampling_params import SamplingParams
from minillm.structured.compiler import GrammarService
from minillm.structured.spec import SpecError, from_response_format, from_structured_outputs
from minillm.structured.tools import ToolCallStream, parse_tool_calls, resolve_tool_choice, parse_tools

DEMO_TOKENIZER = __import__("minillm").__path__[0] + "/demo_model/tokenizer.json"


# ---- the mask op ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [None, [0, 2]])
def test_grammar_mask_matches_a_plain_loop(rows):
    torch.manual_seed(0)
    n, v = 3, 70
    logits = torch.randn(n, v)
    m = n if rows is None else len(rows)
    bitmask = torch.randint(-2**31, 2**31 - 1, (m, (v + 31) // 32), dtype=torch.int32)
    want = logits.clone()
    for j in range(m):
        row = j if rows is None else rows[j]
        for t in range(v):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    got = logits.clone()
    apply_grammar_mask(got, GrammarMask(bitmask, None if rows is None else torch.tensor(rows)))
    assert torch.equal(got, want)
    if rows is not None:
        assert torch.equal(got[1], logits[1])   # the unconstrained row is untouched


# ---- specs and their errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,param", [
    ("rf", {"type": "xml"}, "response_format"),
    ("rf", {"type": "json_schema", "json_schema": {"name": "x"}}, "response_format"),
    ("rf", {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}, "response_format.json_schema.schema"),
    ("so", {"choice": []}, "structured_outputs.choice"),
    ("so", {"choice": ["a", ""]}, "structured_outputs.choice"),
    ("so", {"regex": ""}, "structured_outputs.regex"),
    ("so", {"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ("so", {"jsonn": {}}, "structured_outputs"),
])
def test_bad_specs_name_the_parameter(field, value, param):
    with pytest.raises(SpecError) as e:
        (from_response_format if field == "rf" else from_structured_outputs)(value)
    assert e.value.param == param


@pytest.fixture(scope="module")
def service():
    return GrammarService(DEMO_TOKENIZER, 4096, StructuredConfig())


@pytest.mark.parametrize("so,words", [({"regex": "(ab"}, "parenthesis"), ({"grammar": 'root ::= "a" |'}, "EBNF"),
                                      ({"json": {"type": "string", "format": "nonsense", "pattern": "("}}, "")])
def test_what_only_the_library_can_judge_is_refused_at_compile(service, so, words):
    with pytest.raises(SpecError) as e:
        service.compiled(from_structured_outputs(so))
    assert e.value.param.startswith("structured_outputs") and words in str(e.value)


def test_compile_bounds_refuse_instead_of_hanging():
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 40} for i in range(400)},
           "required": [f"k{i}" for i in range(400)]}
    spec = from_structured_outputs({"json": big})
    slow = GrammarService(DEMO_TOKENIZER, 4096, StructuredConfig(compile_timeout_s=1e-4))
    with pytest.raises(SpecError, match="did not compile within"):
        slow.compiled(spec)
    small = GrammarService(DEMO_TOKENIZER, 4096, StructuredConfig(max_grammar_bytes=1024))
    with pytest.raises(SpecError, match="max_grammar_bytes"):
        small.compiled(spec)
    tight = GrammarService(DEMO_TOKENIZER, 4096, StructuredConfig(max_spec_bytes=100))
    with pytest.raises(SpecError, match="max_spec_bytes"):
        tight.compiled(spec)


def test_compact_json_has_no_whitespace_and_any_is_bounded(service):
    import xgrammar as xgr

    spec = from_structured_outputs({"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]}})
    compact = xgr.GrammarMatcher(service.compiled(spec))
    assert compact.accept_string('{"a":1}') and compact.is_completed()
    assert not xgr.GrammarMatcher(service.compiled(spec)).accept_string('{"a": 1}')
    loose = GrammarService(DEMO_TOKENIZER, 4096, StructuredConfig(json_whitespace="any", max_whitespace=2))
    assert xgr.GrammarMatcher(loose.compiled(spec)).accept_string('{"a":  1}')
    assert not xgr.GrammarMatcher(loose.compiled(spec)).accept_string('{"a":   1}')


def test_matcher_rolls_back_to_the_outputs_the_engine_holds(service):
    import xgrammar as xgr
    from minillm.structured.matchers import GrammarState, Matchers, RowWork

    spec = from_structured_outputs({"regex": "[a-z]{1,8}"})
    tok = __import__("tokenizers").Tokenizer.from_file(DEMO_TOKENIZER)
    ids = tok.encode("abcdef").ids
    assert len(ids) >= 2
    m = Matchers(None, 4096, StructuredConfig())
    m.states["r"] = st = GrammarState(xgr.GrammarMatcher(service.compiled(spec)))
    got = np.zeros((1, 128), dtype=np.int32)
    m.fill([RowWork(0, "r", 0, tuple(ids), len(ids), False)], got)
    assert st.accepted == len(ids)
    m.fill([RowWork(0, "r", 1, (), 1, False)], got)   # the engine dropped all but the first output
    fresh = xgr.GrammarMatcher(service.compiled(spec))
    assert fresh.accept_token(ids[0])
    want = xgr.allocate_token_bitmask(1, 4096)
    fresh.fill_next_token_bitmask(want)
    assert st.accepted == 1 and st.history == ids[:1] and np.array_equal(got, want.numpy())


def test_a_steady_fill_follows_on_from_the_last_with_the_sampled_tokens(service):
    """fill_next: the last fill's rows, each one output further, its token read by the row's slot, and
    min_tokens' ban lifted where the request reaches it: the bitmask of the fill the engine would have sent."""
    import xgrammar as xgr
    from minillm.structured.matchers import GrammarState, Matchers, RowWork

    tok = __import__("tokenizers").Tokenizer.from_file(DEMO_TOKENIZER)
    ids = [tok.token_to_id(c) for c in "abc"]
    spec = from_structured_outputs({"regex": "[a-z]{1,8}"})
    assert None not in ids
    eos = ids[2]   # stands in for EOS: min_tokens bans it, and the grammar allows it in both rows

    def matchers():
        m = Matchers(None, 4096, StructuredConfig())
        for rid in "rs":   # min_tokens 2: the banned token is cleared while fewer than 2 outputs precede
            m.states[rid] = GrammarState(xgr.GrammarMatcher(service.compiled(spec)), banned=(eos,), min_tokens=2)
        return m

    first = [RowWork(0, "r", 0, (), 0, True, 3), RowWork(1, "s", 0, (ids[0],), 1, True, 1)]
    tokens = np.full(4, -1, dtype=np.int64)
    tokens[3], tokens[1] = ids[0], ids[1]
    steady, full = matchers(), matchers()
    got, want = np.zeros((2, 128), dtype=np.int32), np.zeros((2, 128), dtype=np.int32)
    steady.fill(first, got)
    steady.fill_next(tokens, got)
    full.fill(first, want)
    full.fill([RowWork(0, "r", 0, (ids[0],), 1, True, 3), RowWork(1, "s", 1, (ids[1],), 2, False, 1)], want)
    assert np.array_equal(got, want)
    assert steady.states["s"].history == ids[:2] and steady.last[1][4:] == (2, False, 1)
    allowed = lambda row, t: bool((int(row[t // 32]) >> (t % 32)) & 1)   # noqa: E731
    assert not allowed(got[0], eos) and allowed(got[1], eos)   # r still under min_tokens, s past it
    steady.drop(["s"])
    with pytest.raises(RuntimeError, match="dropped"):
        steady.fill_next(tokens, got)


def test_min_tokens_ban_clears_eos_bits_unless_nothing_else_is_allowed():
    from minillm.structured.matchers import _ban

    banned = np.array([2, 31, 63], dtype=np.int64)   # EOS ids 2 and 63, stop token id 31
    only_banned = [(1 << 2) | -2**31, -2**31, 0, 0]   # the grammar allows nothing but EOS / stop ids
    mask = np.array([[-1, -1, -1, 0], only_banned, [-1, -1, -1, 0]], dtype=np.int32)
    _ban(mask.view(np.uint32), np.array([0, 1]), banned)   # row 2 is past min_tokens: not a banned row
    words = [[x & 0xFFFFFFFF for x in r] for r in mask.tolist()]
    assert words[0] == [0x7FFFFFFB, 0x7FFFFFFF, 0xFFFFFFFF, 0]
    assert words[1] == [x & 0xFFFFFFFF for x in only_banned]   # the ban yields to the grammar
    assert words[2] == [0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0]


def test_the_whitespace_key_reaches_the_engines_grammars():
    import xgrammar as xgr

    spec = from_structured_outputs({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    loose = LLM(device="cpu", max_num_seqs=1, json_whitespace="any")
    assert xgr.GrammarMatcher(loose.compile_grammar(spec).result()).accept_string('{"a": 1}')
    with pytest.raises(ValueError, match="structured.json_whitespace"):
        LLM(device="cpu", json_whitespace="lots")


# ---- tool calls -------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_call_parsing_whole_and_streamed():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, {"get_weather"})
    assert content == "Sure." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert parse_tool_calls(text.replace("get_weather", "other"), {"get_weather"}) == (
        text.replace("get_weather", "other"), [])
    stream, got, out = ToolCallStream({"get_weather"}), [], ""
    for ch in text + "<tool":   # one character at a time; a trailing partial tag is held, then flushed
        c, new = stream.feed(ch)
        out += c
        got += new
    assert out.strip() == "Sure." and [c["function"] for c in got] == [calls[0]["function"]]
    assert stream.finish() == "<tool"


def test_tools_reach_a_template_that_takes_them_and_a_system_block_otherwise():
    from minillm.structured.tools import chat_with_tools

    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    msgs, tools = chat_with_tools(history, TOOLS, "{% for t in tools %}{{ t | tojson }}{% endfor %}")
    assert tools == TOOLS and msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "X"}
    msgs, tools = chat_with_tools(history, TOOLS, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tools is None and msgs[0]["role"] == "system" and '"get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_tool_choice_checks():
    tools = parse_tools(TOOLS)
    assert resolve_tool_choice(None, tools)[0] == "auto"
    assert resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)[0] == "forced"
    with pytest.raises(SpecError, match="not in tools"):
        resolve_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(SpecError):
        parse_tools([{"type": "function", "function": {"name": "x", "parameters": {"type": 3}}}])


# ---- generation -------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["x", "y"]}},
          "required": ["name", "n", "tag"]}


@pytest.fixture(scope="module")
def llm():
    # A small KV pool (8 blocks of 16 tokens), so four 50-token requests preempt each other.
    return LLM(device="cpu", max_num_seqs=4, num_kv_blocks=8, max_model_len=128, check_integrity=True)


def _json(params_kw, so=None, rf=None):
    spec = from_structured_outputs(so) if so is not None else from_response_format(rf)
    return SamplingParams(structured=spec, **params_kw)


def test_schema_outputs_validate_and_unconstrained_do_not(llm):
    outs = llm.generate(["A person:"], _json(dict(temperature=1.0, max_tokens=80, seed=1, n=2),
                                             rf={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
                        use_tqdm=False)[0].outputs
    assert all(c.finish_reason == "stop" for c in outs)
    for c in outs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    free = llm.generate(["A person:"], SamplingParams(temperature=1.0, max_tokens=30, seed=1), use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(free[0].outputs[0].text)


@pytest.mark.slow
def test_async_sync_preemption_and_prefix_hits_give_the_same_constrained_tokens(llm):
    pattern = "[a-z]{50,70}-[0-9]{2}"
    params = _json(dict(temperature=1.0, max_tokens=40, seed=7), so={"regex": pattern})
    # Prompts of more than one block (so a repeat hits the prefix cache); 4 x (prompt + outputs) > 8 blocks.
    prompts = [f"{w} " * 20 for w in ("one", "two", "three", "four")]
    before = llm.num_preemptions
    async_outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.num_preemptions > before   # the small pool forced recomputation
    core = llm.engine.core
    cfg = core.cfg
    core.cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, async_scheduling=False))
    try:
        sync_outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.cfg = cfg
    assert [o.outputs[0].token_ids for o in async_outs] == [o.outputs[0].token_ids for o in sync_outs]
    again = llm.generate(prompts[3:], params, use_tqdm=False)[0]   # its prompt blocks were freed last: a hit
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == sync_outs[3].outputs[0].token_ids
    for o in async_outs:
        c = o.outputs[0]
        assert re.fullmatch(pattern, c.text) if c.finish_reason == "stop" else re.fullmatch("[a-z]*-?[0-9]?", c.text)


def test_min_tokens_does_not_fight_a_complete_grammar(llm):
    out = llm.generate(["x"], _json(dict(temperature=1.0, max_tokens=20, min_tokens=10), so={"choice": ["ok"]}),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"


def test_a_stop_string_ends_a_constrained_output(llm):
    params = _json(dict(temperature=1.0, max_tokens=30, seed=5, stop=["-"]), so={"regex": "[a-z]{3,8}-[0-9]{2}"})
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[a-z]{3,8}", out.text), out.text


def test_ignore_eos_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="ignore_eos"):
        _json(dict(ignore_eos=True), so={"choice": ["a"]})


# Random schemas: bounded strings, integers, enums, booleans, arrays and nested objects.
_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(lambda lo, d: {"type": "integer", "minimum": lo, "maximum": lo + d}, st.integers(-50, 50),
              st.integers(0, 100)),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3,
                                                unique=True)),
    st.just({"type": "boolean"}),
)


def _containers(inner):
    arrays = st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, inner, st.integers(0, 3))
    objects = st.dictionaries(st.text("pqrs", min_size=1, max_size=3), inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})
    return st.one_of(arrays, objects)


_node = st.recursive(_leaf, _containers, max_leaves=4)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_node.filter(lambda s: s.get("type") != "boolean"))
def test_random_schemas_are_satisfied_or_refused(llm, schema):
    try:
        params = _json(dict(temperature=1.0, max_tokens=120, seed=3), so={"json": schema})
        out = llm.generate(["Data:"], params, use_tqdm=False)[0].outputs[0]
    except SpecError:
        return   # refused cleanly, naming the parameter
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)


def test_min_tokens_ban_on_rows_that_are_not_contiguous():
    from minillm.structured.matchers import _ban

    words = np.full((4, 3), 0xFFFFFFFF, dtype=np.uint32)
    words[2] = 0
    words[2, 1] = 1 << 3                      # row 2 allows only token 35, which is banned: it keeps it
    _ban(words, np.array([0, 2, 3]), np.array([35, 64, 1], dtype=np.int64))
    assert words[0].tolist() == [0xFFFFFFFD, 0xFFFFFFF7, 0xFFFFFFFE]
    assert words[1].tolist() == [0xFFFFFFFF] * 3   # not a banned row
    assert words[2].tolist() == [0, 1 << 3, 0]
    assert words[3].tolist() == words[0].tolist()


def test_mask_thread_fills_in_order_and_reports_a_failed_open_at_the_next_wait(service):
    import xgrammar as xgr
    from minillm.structured.mask_thread import MaskThread
    from minillm.structured.matchers import GrammarState, RowWork

    spec = from_structured_outputs({"regex": "[a-z]{1,8}"})
    t = MaskThread(None, 4096, StructuredConfig())
    try:
        t.matchers.states["r"] = GrammarState(xgr.GrammarMatcher(service.compiled(spec)))
        got = np.zeros((1, 128), dtype=np.int32)
        t.fill(0, [RowWork(0, "r", 0, (), 0, False)], got)
        assert t.wait(0, got) is got
        want = xgr.allocate_token_bitmask(1, 4096)
        xgr.GrammarMatcher(service.compiled(spec)).fill_next_token_bitmask(want)
        assert np.array_equal(got, want.numpy())
        t.open("bad", spec, (), ())          # no model directory: this open fails on the thread
        t.fill(1, [], got[:0])
        with pytest.raises(RuntimeError, match="grammar matcher open failed"):
            t.wait(1, got[:0])
        with pytest.raises(RuntimeError, match="no grammar mask fill is pending"):
            t.wait(1, got[:0])
    finally:
        t.close()
    assert not t._pool._threads or not any(th.is_alive() for th in t._pool._threads)


def test_masks_waited_for_at_once_give_the_deferred_tokens(llm):
    """defer=False (tensor parallelism: rank 0 launches its sampler in order) samples the same constrained tokens
    as the default, where the sampler waits for the next launch."""
    params = _json(dict(temperature=1.0, max_tokens=24, seed=3, min_tokens=4),
                   so={"regex": "[a-z]{3,9}(-[0-9]{1,3}){2}"})
    grammar = llm.engine.runner.grammar
    runs = []
    for defer in (True, False):
        grammar.defer = defer
        try:
            runs.append([o.outputs[0].token_ids for o in llm.generate(["a:", "b:"], params, use_tqdm=False)])
        finally:
            grammar.defer = True
    assert runs[0] == runs[1] and all(len(t) >= 4 for t in runs[0])


def test_overlap_masks_is_a_checked_config_key_that_reaches_the_runner():
    from minillm.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="structured.overlap_masks"):
        EngineConfig.from_kwargs(None, structured_overlap_masks="yes").validate()
    with LLM(device="cpu", max_num_seqs=1, structured_overlap_masks=False) as serial:
        assert serial.engine.runner.grammar.defer is False
