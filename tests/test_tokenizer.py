"""Tokenizer tests on a small byte-level BPE trained here (CJK, emoji and accented text included), plus the
EOS union and chat-template rendering. `write_tokenizer_dir` is shared with test_detokenizer.py."""
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from minillm.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "façade", "Ørsted",
         "Ελληνικά", "日本語", "のテキスト", "中文字符", "测试", "한국어", "😀", "🎉", "👍🏽", "end", "stop", "!", "\n"]

QWEN_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>' + (message.content | tojson) + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def corpus(n_lines: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n_lines)]


def write_tokenizer_dir(path: Path, *, vocab_size: int = 300, tokenizer_config: dict | None = None,
                        config: dict | None = None, generation_config: dict | None = None) -> Path:
    """Train a byte-level BPE small enough that CJK characters and emoji span several tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    for name, data in (("tokenizer_config.json", tokenizer_config), ("config.json", config),
                       ("generation_config.json", generation_config)):
        if data is not None:
            (path / name).write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"),
                               tokenizer_config={"eos_token": "<|im_end|>", "bos_token": None,
                                                 "chat_template": QWEN_LIKE_TEMPLATE},
                               config={"eos_token_id": 0}, generation_config={"eos_token_id": [2, 7]})


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_round_trip_multibyte_text(tok):
    text = "naïve café 日本語のテキスト 😀🎉 👍🏽 Ελληνικά 한국어"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # The tokenizer really splits characters: some single token decodes to a broken character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_special_tokens_skipped_on_request(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.token_to_id("<|im_end|>") in ids
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_vocab_size_counts_added_tokens(tok):
    assert tok.vocab_size == 300
    assert tok.token_to_id("<|im_end|>") < tok.vocab_size


def test_encode_rejects_non_string(tok):
    with pytest.raises(ValueError, match="text must be a string"):
        tok.encode(["not", "text"])


def test_eos_ids_are_the_union_of_all_sources(tok):
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end == 2
    assert tok.eos_token_ids == frozenset({0, 2, 7})


def test_eos_from_generation_config_int(tmp_path):
    d = write_tokenizer_dir(tmp_path / "t", generation_config={"eos_token_id": 1})
    assert Tokenizer.from_dir(d).eos_token_ids == frozenset({1})


def test_bad_eos_field_and_bad_json_named(tmp_path):
    d = write_tokenizer_dir(tmp_path / "t", config={"eos_token_id": "x"})
    with pytest.raises(ValueError, match="config.json: eos_token_id"):
        Tokenizer.from_dir(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        Tokenizer.from_dir(d)


def test_chat_template_generation_prompt_and_thinking(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 日本"}]
    body = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 日本<|im_end|>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == body
    assert tok.apply_chat_template(msgs) == body + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, enable_thinking=True) == body + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, enable_thinking=False) == (
        body + "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_tojson_keeps_unicode(tok):
    out = tok.apply_chat_template([{"role": "tool", "content": "café \"x\""}], add_generation_prompt=False)
    assert '<tool_response>"café \\"x\\""</tool_response>' in out


@pytest.mark.parametrize("messages, match", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
    ([{"content": "a"}], r"messages\[0\] is missing \"role\""),
    ([{"role": "user"}], r"messages\[0\] is missing \"content\""),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
    ([{"role": 3, "content": "a"}], r"messages\[0\]\.role must be a string"),
    ([{"role": "", "content": "a"}], r"messages\[0\]\.role must be a non-empty"),
])
def test_bad_messages_rejected(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_template_raise_exception_becomes_value_error(tok):
    with pytest.raises(ValueError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_template_sources(tmp_path):
    plain = write_tokenizer_dir(tmp_path / "plain")
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(plain).apply_chat_template([{"role": "user", "content": "a"}])
    named = write_tokenizer_dir(tmp_path / "named", tokenizer_config={"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}]})
    assert Tokenizer.from_dir(named).apply_chat_template([{"role": "user", "content": "a"}]) == "D1"
    (named / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert Tokenizer.from_dir(named).apply_chat_template([{"role": "user", "content": "a"}]) == "Ja"


def test_sandbox_blocks_unsafe_attribute_access(tmp_path):
    d = write_tokenizer_dir(tmp_path / "t", tokenizer_config={
        "chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "a"}])
