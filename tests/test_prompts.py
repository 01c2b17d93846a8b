"""Prompt preparation: chat messages through the model's template, with Qwen3's enable_thinking switch."""
import json

import pytest

from minillm import LLM, SamplingParams
from minillm.serve.requests import LineError, parse_line
from tiny_models import DEMO_MODEL, make_tiny_checkpoint, with_demo_tokenizer

THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = with_demo_tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("chat"), vocab=4096, seed=5),
                               files=("tokenizer.json",))
    cfg = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=128)


MESSAGES = [{"role": "user", "content": "Open the file."}]


def test_enable_thinking_reaches_the_template(llm):
    prep = llm.engine.prompts.prepare
    on, off, default = (prep(MESSAGES, SamplingParams(), t) for t in (True, False, None))
    assert on == default and len(off) > len(on)
    assert llm.tokenizer.decode(list(off[len(on):]), skip_special_tokens=False).strip().startswith("<think>")
    out = llm.generate([MESSAGES], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                       enable_thinking=False)[0]
    assert out.prompt_token_ids == list(off)


def test_jsonl_enable_thinking_is_validated():
    ok = parse_line(1, json.dumps({"messages": MESSAGES, "enable_thinking": False}).encode(), {})
    assert ok.enable_thinking is False
    for bad in ({"prompt": "x", "enable_thinking": True}, {"messages": MESSAGES, "enable_thinking": "no"}):
        with pytest.raises(LineError, match="enable_thinking"):
            parse_line(2, json.dumps(bad).encode(), {})


def test_prepared_ids_are_rechecked_only_where_params_matter(llm):
    """A front end prepares a prompt with its own params, then admits the ids under the final ones: the length
    and stop checks run again, the per-id pass does not (the ids came from prepare)."""
    prompts = llm.engine.prompts
    ids = prompts.prepare([5, 6, 7], SamplingParams(max_tokens=1))
    assert prompts.recheck(ids, SamplingParams(max_tokens=100)) == [5, 6, 7]
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        prompts.recheck(ids, SamplingParams(max_tokens=126))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prompts.prepare([5, 10 ** 6], SamplingParams())
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        prompts.recheck(ids, SamplingParams(stop=["\ud800"]))
    with pytest.raises(TypeError, match="what prepare"):   # plain ids never skip the per-id pass
        prompts.recheck([5, 6, 7], SamplingParams())
    bad = [5, 10 ** 6]   # a plain list is prepared (checked) again by add_request
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request(bad, SamplingParams(max_tokens=2))
    rid = llm.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    out = []
    while llm.engine.has_unfinished_requests():
        out += [o for o in llm.engine.step() if o.output is not None]
    assert [o.request_id for o in out] == [rid] and out[0].output.prompt_token_ids == [5, 6, 7]
    assert len(out[0].output.outputs[0].token_ids) == 2
