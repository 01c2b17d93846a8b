"""Tokenizer of an HF model directory: `tokenizers` for text <-> ids, jinja2 for the chat template.

Files read: tokenizer.json (required), tokenizer_config.json (chat_template, bos/eos token), chat_template.jinja
(newer exports keep the template there; it wins over the config's copy), config.json and generation_config.json
(EOS ids). Qwen3 stops on several ids (e.g. <|im_end|> and <|endoftext|>), so eos_token_ids is the union of
every source rather than any single one.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from minillm.chat_template import TemplateRenderer
from minillm.chat_template_worker import environment
from minillm.untrusted import loads_json, short_repr

MAX_RENDERED_CHARS = 32 << 20   # a rendering past this is refused even where max_model_len would allow it


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, *, eos_token_ids: frozenset[int] = frozenset(),
                 chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        self._tok = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {str(root)!r}: a text prompt, chat messages or stop "
                                    f"strings need the model's tokenizer.json")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:   # noqa: BLE001 - the tokenizers library raises bare Exceptions for bad files
            raise ValueError(f"{tok_file} is not a tokenizer file the tokenizers library can read: "
                             f"{str(e)[:200]}") from None
        tok_cfg = _read_json(root / "tokenizer_config.json")
        bos, eos = _token_text(tok_cfg.get("bos_token")), _token_text(tok_cfg.get("eos_token"))
        eos_ids = _ids_of(_read_json(root / "config.json").get("eos_token_id"), "config.json")
        eos_ids |= _ids_of(_read_json(root / "generation_config.json").get("eos_token_id"), "generation_config.json")
        if eos is not None and tok.token_to_id(eos) is not None:
            eos_ids.add(tok.token_to_id(eos))
        return cls(tok, eos_token_ids=frozenset(eos_ids), chat_template=_chat_template(root, tok_cfg),
                   bos_token=bos, eos_token=eos)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (a model's embedding may be wider)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        # encode_batch releases the GIL while it works (encode holds it): a long prompt tokenized on a worker
        # thread then leaves the server's event loop running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def max_chars_per_token(self) -> int | None:
        """An upper bound on the characters of text one token can stand for, or None where there is none (a
        tokenizer with an unknown token can map a whole word to it). Byte-level BPE covers each byte of the text
        with exactly one token, and a token holds at most its vocabulary string's length in bytes; a normalizer
        (NFC) may compose a few characters into one, so it gets a factor of 4."""
        model = self._tok.model
        if type(model).__name__ != "BPE" or (getattr(model, "unk_token", None) and not model.byte_fallback):
            return None
        longest = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if self._tok.normalizer is not None else 1)

    @cached_property
    def decodes_by_concatenation(self) -> bool:
        """Whether decode(a + b) == decode(a) + decode(b) whenever decode(a) does not end in an unfinished
        character: true of a byte-level decoder (the ids' bytes joined, then decoded as UTF-8), which the
        incremental detokenizer then need not call per token. Other decoders (Metaspace, WordPiece) rewrite
        text at token boundaries."""
        return type(self._tok.decoder).__name__ == "ByteLevel"

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool | None = None, tools: Sequence[dict] | None = None,
                            max_chars: int = MAX_RENDERED_CHARS) -> str:
        """Render chat messages with the model's template, in a worker process bounded in time, memory and
        output (max_chars; see minillm/chat_template.py). ``enable_thinking`` is passed to the template only when
        given (Qwen3's template treats an undefined value as "thinking on"); ``tools`` likewise (Qwen3's
        template renders them itself)."""
        _validate_messages(messages)
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); "
                             "pass a plain text prompt instead")
        variables: dict[str, Any] = dict(messages=[dict(m) for m in messages],
                                         add_generation_prompt=bool(add_generation_prompt),
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        if enable_thinking is not None:
            variables["enable_thinking"] = bool(enable_thinking)
        if tools:
            variables["tools"] = [dict(t) for t in tools]
        self._template   # a syntax error is named here, before any worker starts
        return self._renderer.render(variables, max_chars)

    @cached_property
    def _template(self) -> jinja2.Template:
        """The template compiled here only to report syntax errors (compiling runs none of its code)."""
        try:
            return environment().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template is not valid jinja (line {e.lineno}): {e.message}") from e

    @cached_property
    def _renderer(self) -> TemplateRenderer:
        return TemplateRenderer(self.chat_template)


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\": str, \"content\": str} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with \"role\" and \"content\", "
                             f"got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] is missing \"{key}\"")
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string, got {type(m[key]).__name__}")
        if not m["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError, TooNested, bad UTF-8
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} must hold a JSON object, got {type(data).__name__}")
    return data


def _ids_of(value: Any, source: str) -> set[int]:
    """An eos_token_id field: absent, one id, or a list of ids."""
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{source}: eos_token_id must be a non-negative integer or a list of them, "
                         f"got {short_repr(value)}")
    return set(values)


def _token_text(value: Any) -> str | None:
    """bos/eos entries are either the token string or an AddedToken-like object {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(root: Path, tok_cfg: dict) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja_file} is not UTF-8 text: {e}") from None
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one named "default" is the chat template.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError("tokenizer_config.json: chat_template must be a string or a list of named templates")
    return template
