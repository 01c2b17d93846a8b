"""OpenAI response shapes: whole responses, SSE stream chunks, logprobs and usage.

Completions and chat share one stream formatter; they differ in the chunk's object name and in how a delta is
written (`text` vs `delta.content`, list-style vs content-style logprobs).

Logprobs are always valid JSON: -inf is written as -9999.0 and NaN as null (see json_logprob).
A streamed chunk carries the logprobs of the tokens it adds (StepOutput.logprobs); concatenating every chunk's
logprobs gives the whole list, in order.
"""
from __future__ import annotations

from functools import lru_cache

import msgspec

from minillm.serve.generate_jsonl import json_logprob
from minillm.serve.generate_jsonl import usage as usage_counts
from minillm.structured.tools import ToolCallStream, parse_tool_calls

DONE = "data: [DONE]\n\n"
_JSON = msgspec.json.Encoder()


def sse(obj: dict) -> str:
    # msgspec writes the compact UTF-8 JSON of json.dumps(ensure_ascii=False, separators=(",", ":")) (a float may be
    # spelled otherwise, 0.00001 for 1e-05: the same number) about ten times faster. Every chunk of every stream is
    # encoded here on the event loop, and the first one of a completion with return_token_ids carries the prompt.
    return f"data: {_JSON.encode(obj).decode()}\n\n"


class TokenText:
    """Token id -> its text for logprobs (vLLM's form `token_id:N` when the model has no tokenizer)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._text)

    def _text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def usage_json(outputs) -> dict:
    """Usage over every prompt of the request: prompt, completion and cached prompt tokens."""
    prompt = completion = cached = 0
    for out in outputs:
        counts = usage_counts(out)
        prompt += counts["prompt_tokens"]
        completion += counts["completion_tokens"]
        cached += out.num_cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(lps, token_text: TokenText) -> dict:
    tokens = [token_text.text(lp.token_id) for lp in lps]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [json_logprob(lp.logprob) for lp in lps],
            "top_logprobs": [{token_text.text(t): json_logprob(v) for t, v in lp.top.items()} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(lps, token_text: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text.text(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]}


class Shape:
    """What one request's answers look like: endpoint, ids, and the options that change the JSON."""

    def __init__(self, chat: bool, response_id: str, created: int, model: str, n: int, logprobs: bool,
                 return_token_ids: bool, include_usage: bool, token_text: TokenText,
                 tools: set[str] | None = None):
        self.chat, self.id, self.created, self.model, self.n = chat, response_id, created, model, n
        self.logprobs, self.return_token_ids, self.include_usage = logprobs, return_token_ids, include_usage
        self.token_text = token_text
        self.tools = tools   # function names whose <tool_call> blocks become message.tool_calls; None = none

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs_json(self, lps):
        if lps is None:
            return None
        return chat_logprobs(lps, self.token_text) if self.chat else completion_logprobs(lps, self.token_text)

    def message(self, text: str, choice: dict) -> dict:
        """The assistant message of a whole chat response: tool calls parsed out of the text when tools apply."""
        if self.tools is None:
            return {"role": "assistant", "content": text}
        content, calls = parse_tool_calls(text, self.tools)
        if not calls:
            return {"role": "assistant", "content": text}
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": calls}

    # ---- whole responses -------------------------------------------------------------------------------------
    def response(self, outputs: list) -> dict:
        """outputs: the RequestOutput of every prompt, in prompt order (choice index = prompt * n + completion)."""
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                choice = {"index": p * self.n + c.index, "logprobs": self.logprobs_json(c.logprobs),
                          "finish_reason": c.finish_reason}
                if self.chat:
                    choice["message"] = self.message(c.text, choice)
                else:
                    choice["text"] = c.text
                if self.return_token_ids:
                    choice["token_ids"] = c.token_ids
                    if not self.chat:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                choices.append(choice)
        body = {**self.head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage_json(outputs)}
        if self.chat and self.return_token_ids:
            body["prompt_token_ids"] = outputs[0].prompt_token_ids
        return body


class StreamFormatter:
    """StepOutputs of one HTTP request -> SSE events. `prompts` maps each engine request id, in prompt order, to
    its prompt token ids; its first choice index is its prompt number * n."""

    def __init__(self, shape: Shape, prompts: dict[str, list[int]]):
        self.shape, self.prompts = shape, prompts
        self.bases = {rid: p * shape.n for p, rid in enumerate(prompts)}
        self.outputs: dict[str, object] = {}     # engine request id -> its final RequestOutput
        self._started: set[int] = set()          # return_token_ids: choices whose first chunk went out
        self._obj = "chat.completion.chunk" if shape.chat else "text_completion"
        self._tool_streams: dict[int, ToolCallStream] = {}   # choice index -> its parser (chat with tools)

    def start(self) -> str:
        """Chat streams open every choice with the assistant role, before any token (as OpenAI and vLLM do)."""
        if not self.shape.chat:
            return ""
        extra = {"prompt_token_ids": next(iter(self.prompts.values()))} if self.shape.return_token_ids else None
        return "".join(self._chunk(i, {"role": "assistant", "content": ""}, None, None, None,
                                   top=extra if i == 0 else None) for i in range(self.shape.n))

    def on_output(self, so) -> str:
        index = self.bases[so.request_id] + so.index
        finish = so.finish_reason if so.finished else None
        if so.output is not None:
            self.outputs[so.request_id] = so.output
        if not (so.new_token_ids or so.new_text or finish is not None):
            return ""
        # each chunk carries the logprobs of its own tokens, as OpenAI and vLLM stream them
        lps = self.shape.logprobs_json(so.logprobs) if self.shape.logprobs and so.logprobs else None
        return self._delta(index, so.new_text, so.new_token_ids, lps, finish, so)

    def end(self) -> str:
        tail = ""
        if self.shape.include_usage:
            usage = usage_json([self.outputs[r] for r in self.prompts if r in self.outputs])
            tail = sse({**self.shape.head(self._obj), "choices": [], "usage": usage})
        return tail + DONE

    def _delta(self, index: int, text: str, token_ids, lps, finish, so) -> str:
        extra = None
        if self.shape.return_token_ids:
            extra = {"token_ids": list(token_ids)}
            if index not in self._started and not self.shape.chat:
                extra["prompt_token_ids"] = self.prompts[so.request_id]
            self._started.add(index)
        if self.shape.chat and self.shape.tools is not None:
            return self._tool_delta(index, text, lps, finish, extra)
        delta = {"content": text} if self.shape.chat else text
        return self._chunk(index, delta, lps, finish, extra)

    def _tool_delta(self, index: int, text: str, lps, finish, extra) -> str:
        """Content deltas with call blocks taken out, each finished call as one tool_calls delta (as OpenAI
        streams them: index, id, type and name, and the arguments), finish_reason tool_calls after a call."""
        parser = self._tool_streams.setdefault(index, ToolCallStream(self.shape.tools))
        content, calls = parser.feed(text)
        if finish is not None:
            content += parser.finish()
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
        out = []
        for call in calls:
            k = parser.calls - len(calls) + len(out)
            out.append(self._chunk(index, {"tool_calls": [{"index": k, **call}]}, None, None, None))
        if content or finish is not None or lps or extra:
            out.append(self._chunk(index, {"content": content}, lps, finish, extra))
        return "".join(out)

    def _chunk(self, index: int, delta, lps, finish, extra, top=None) -> str:
        choice = {"index": index, ("delta" if self.shape.chat else "text"): delta, "logprobs": lps,
                  "finish_reason": finish}
        if extra:
            choice.update(extra)
        body = {**self.shape.head(self._obj), "choices": [choice], **(top or {})}
        if self.shape.include_usage:
            body["usage"] = None
        return sse(body)
