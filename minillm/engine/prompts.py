"""Prompt preparation: text, token ids or chat messages -> validated prompt token ids; and the text side
(tokenizer, detokenizers, EOS ids) of the engine. Validation raises ValueError and changes no state."""
from __future__ import annotations

from pathlib import Path

from minillm.limits import check_request
from minillm.sampling_params import SamplingParams


class PreparedPrompt(tuple):
    """Prompt token ids that PromptPreparer.prepare checked, id by id. Only prepare makes one, and a tuple cannot
    change afterwards, so add_request may admit it without a second pass over its ids (recheck)."""
    __slots__ = ()


class PromptPreparer:
    def __init__(self, model_dir: Path | None, arch, max_model_len: int, max_num_seqs: int | None = None):
        self.vocab_size = arch.vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.tokenizer = None
        if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
            from minillm.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_dir(model_dir)
        eos = arch.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

    def prepare(self, prompt, params: SamplingParams, enable_thinking: bool | None = None,
                tools: list[dict] | None = None) -> PreparedPrompt:
        """tools: OpenAI function tools for the chat template (chat messages only; minillm/structured/tools.py)."""
        return PreparedPrompt(self._checked(prompt, params, enable_thinking, tools))

    def admit(self, prompt, params: SamplingParams, enable_thinking: bool | None = None) -> list[int]:
        """add_request's prompt ids: a PreparedPrompt is only rechecked where params matter, anything else is
        prepared here."""
        if isinstance(prompt, PreparedPrompt):
            return self.recheck(prompt, params)
        return self._checked(prompt, params, enable_thinking, None)

    def _checked(self, prompt, params: SamplingParams, enable_thinking: bool | None, tools) -> list[int]:
        check_request(params, self.vocab_size, self.max_num_seqs)
        _check_text(prompt, params)
        ids = self._to_ids(prompt, enable_thinking, tools)
        if not ids:
            raise ValueError("prompt is empty")
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        self._check_fit(ids, params)
        return ids

    def recheck(self, ids: PreparedPrompt, params: SamplingParams) -> list[int]:
        """What prepare() returned, now under `params` (e.g. another max_tokens): only the checks that depend on
        params run again. A front end that prepared the prompt on its own thread admits it this way without a
        second pass over every id (0.5 ms at 7,680 ids)."""
        if not isinstance(ids, PreparedPrompt):
            raise TypeError(f"recheck takes what prepare() returned, got {type(ids).__name__}")
        check_request(params, self.vocab_size, self.max_num_seqs)
        _check_stop(params)
        self._check_fit(ids, params)
        return list(ids)

    def _check_fit(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids):,} tokens; max_model_len ({self.max_model_len}) leaves no room "
                             f"for output")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model directory has no tokenizer.json")

    def _to_ids(self, prompt, enable_thinking: bool | None, tools=None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self._encode(self._need_tokenizer("a text prompt"), prompt, "prompt")
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            tokenizer = self._need_tokenizer("chat messages")
            messages = list(prompt)
            if tools is not None:
                from minillm.structured.tools import chat_with_tools
                messages, tools = chat_with_tools(messages, tools, tokenizer.chat_template)
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                                                 tools=tools, max_chars=self._max_chars(tokenizer))
            return self._encode(self.tokenizer, text, "the chat template's rendering of messages")
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a list of chat messages, "
                         f"got {type(prompt).__name__}")

    def _max_chars(self, tokenizer) -> int:
        """The longest chat-template rendering worth producing: what max_model_len tokens can hold."""
        from minillm.tokenizer import MAX_RENDERED_CHARS
        per_token = tokenizer.max_chars_per_token
        return MAX_RENDERED_CHARS if per_token is None else min(MAX_RENDERED_CHARS, self.max_model_len * per_token)

    def _encode(self, tokenizer, text: str, what: str) -> list[int]:
        """Tokenize, refusing at once a text too long for max_model_len tokens whatever it holds (7.9 MB took
        seconds to tokenize only to be refused)."""
        per_token = tokenizer.max_chars_per_token
        if per_token is not None and len(text) > self.max_model_len * per_token:
            raise ValueError(f"{what} is {len(text):,} characters: more than max_model_len ({self.max_model_len}) "
                             f"tokens can hold (at most {self.max_model_len * per_token:,} characters here)")
        return tokenizer.encode(text)

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and this model has no tokenizer.json; "
                             "pass prompt token ids instead")
        return self.tokenizer

    def detokenizer(self, params: SamplingParams):
        if self.tokenizer is None:
            return None
        from minillm.detokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, list(params.stop))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""


def _check_text(prompt, params: SamplingParams) -> None:
    """Refuse text that is not Unicode: a lone UTF-16 surrogate ("\\ud800" in JSON) has no UTF-8 form, and the
    tokenizer would fail on it with a TypeError."""
    if isinstance(prompt, str):
        _check_str(prompt, "prompt")
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):   # not token ids
        for i, m in enumerate(prompt):
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                _check_str(m["content"], f"messages[{i}].content")
    _check_stop(params)


def _check_stop(params: SamplingParams) -> None:
    for s in params.stop:
        _check_str(s, "stop strings: one")


def _check_str(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), which is "
                         f"not valid Unicode text") from None
