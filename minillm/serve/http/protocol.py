"""Request bodies of /v1/completions and /v1/chat/completions, and their SamplingParams.

Pydantic checks types (strict: no "1" for 1, no 1.5 for an integer, no NaN) and names unknown fields, as OpenAI
does; SamplingParams checks ranges, so the limits live in one place for every front end. Parameters OpenAI lists
but minillm does not implement are accepted at their neutral value (null, false, empty) and refused otherwise,
so a client never gets something other than what it asked for in silence. minillm's extras use vLLM's names.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from minillm.sampling_params import SamplingParams
from minillm.serve.http.errors import APIError
from minillm.structured.spec import GrammarSpec, SpecError, spec_from_request

# OpenAI body field -> SamplingParams field (when the names differ; other shared names map to themselves).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                    "ignore_eos", "seed", "n", "presence_penalty", "frequency_penalty", "repetition_penalty")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Common(_Strict):
    """What both endpoints take. None = not given: the server's sampling defaults (the config's `sampling`)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI parameters without an implementation here: neutral values only (see UNSUPPORTED)
    logit_bias: dict[str, float] | None = None
    # minillm's extras (vLLM's names), sent by the openai client through extra_body
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    return_token_ids: bool | None = False   # vLLM's: token ids of the prompt and of every choice / delta
    # Structured outputs (minillm/structured/): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_Common):
    # list[int] before list[str]: a strict list[str] checks every id of a token-id prompt before it fails (1-2 ms
    # at 8k ids, on the event loop), while list[int] passes it, or fails a list of strings at its first entry.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Lenient on extra keys: clients send earlier assistant messages back as they got them (refusal, annotations,
    # audio: null, ...). Keys that would change the prompt are refused in check_request.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI parameters without an implementation here: neutral values only (see UNSUPPORTED)
    functions: list[Any] | None = None
    function_call: Any | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: Any | None = None
    prediction: Any | None = None
    web_search_options: Any | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


# field -> the values that mean "not used"; anything else is refused with 400 naming the field
UNSUPPORTED = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
               "functions": (None, []), "function_call": (None, "none"), "reasoning_effort": (None,),
               "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "web_search_options": (None,)}


def check_request(req: _Common) -> None:
    """Cross-field rules and unsupported parameters (400 naming the field)."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    for name, neutral in UNSUPPORTED.items():
        if name in type(req).model_fields and getattr(req, name) not in neutral:
            raise APIError(400, f"{name} is not supported by this server (allowed: {_fmt(neutral)})", param=name)
    if isinstance(req, ChatRequest):
        for i, m in enumerate(req.messages):
            if m.tool_calls and m.role != "assistant":
                raise APIError(400, f"messages[{i}].tool_calls is only allowed on assistant messages",
                               param="messages")
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise APIError(400, f"messages[{i}].content is missing (only an assistant message with "
                               "tool_calls may leave it out)", param="messages")


def _fmt(values) -> str:
    return " or ".join("null" if v is None else repr(v).lower() if isinstance(v, bool) else repr(v) for v in values)


def messages_json(req: ChatRequest) -> list[dict]:
    """Chat messages as the engine's chat template takes them ({"role", "content": str})."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(p.text for p in m.content)
        msg = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            msg["name"] = m.name
        out.append(msg)
    return out


def spec_api_error(e: ValueError) -> APIError:
    param = getattr(e, "param", "structured_outputs")
    return APIError(400, str(e), param=param.split(".", 1)[0].split("[", 1)[0])


def constrained(params: SamplingParams, spec: GrammarSpec, req: _Common) -> SamplingParams:
    try:
        return dataclasses.replace(params, structured=spec)
    except ValueError as e:   # ignore_eos with a grammar
        raise APIError(400, str(e), param="ignore_eos" if "ignore_eos" in str(e) else spec.param) from None


def structured_spec(req: _Common) -> GrammarSpec | None:
    """The body's response_format / structured_outputs as one GrammarSpec (400 naming the param)."""
    try:
        return spec_from_request(req.response_format, req.structured_outputs)
    except SpecError as e:
        raise spec_api_error(e) from None


def tool_setup(req: ChatRequest):
    """-> (tools as the template takes them or None, names whose calls are parsed out of the text or None,
    the constraint of a forced call or None). 400 naming tools / tool_choice."""
    from minillm.structured.tools import parse_tools, resolve_tool_choice, tool_call_spec

    try:
        tools = parse_tools(req.tools)
        mode, allowed = resolve_tool_choice(req.tool_choice, tools)
    except SpecError as e:
        raise spec_api_error(e) from None
    rendered = [t.as_openai() for t in tools] or None
    if mode == "none":
        return rendered, None, None
    names = {t.name for t in allowed}
    if mode == "auto":
        return rendered, names, None
    if req.response_format is not None or req.structured_outputs is not None:
        raise APIError(400, "a required or named tool_choice constrains the output already; drop "
                       "response_format / structured_outputs", param="tool_choice")
    return rendered, names, tool_call_spec(allowed)


def enable_thinking(req: ChatRequest) -> bool | None:
    kwargs = req.chat_template_kwargs or {}
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    if unknown:
        raise APIError(400, f"chat_template_kwargs: unknown key(s) {', '.join(map(repr, unknown))}; this server "
                       "passes only enable_thinking to the template", param="chat_template_kwargs")
    value = kwargs.get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise APIError(400, f"chat_template_kwargs.enable_thinking must be true or false, got {value!r}",
                       param="chat_template_kwargs")
    return value


def sampling_params(req: _Common, defaults: dict) -> tuple[SamplingParams, bool]:
    """-> (params, whether max_tokens was given). Defaults fill what the body leaves out; an unset max_tokens is
    capped to the room each prompt leaves (see with_room), so leaving it out never makes a request too long."""
    given = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            given["max_tokens"] = req.max_completion_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.logprobs:
            given["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:
        given["logprobs"] = req.logprobs
    try:
        params = SamplingParams(**{**defaults, **given})
    except (TypeError, ValueError) as e:
        raise _params_error(str(e), req) from None
    return params, "max_tokens" in given


def _params_error(message: str, req: _Common) -> APIError:
    """SamplingParams messages start with the field's name: map it back to the body's name for this endpoint."""
    name = message.split(" ", 1)[0]
    param = name
    if isinstance(req, ChatRequest):
        if name == "logprobs":
            param = "top_logprobs"
        elif name == "max_tokens" and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
    if param not in type(req).model_fields:
        return APIError(400, message)
    return APIError(400, param + message[len(name):], param=param)


def with_room(params: SamplingParams, prompt_len: int, max_model_len: int, req: _Common) -> SamplingParams:
    """The default max_tokens, cut to what max_model_len leaves after this prompt."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens; max_model_len is {max_model_len}, which leaves "
                       "no room for output", param=_prompt_field(req))
    if params.max_tokens <= room:
        return params
    try:
        return dataclasses.replace(params, max_tokens=room)
    except ValueError as e:   # min_tokens above the room left
        raise _params_error(str(e), req) from None


def _prompt_field(req: _Common) -> str:
    return "messages" if isinstance(req, ChatRequest) else "prompt"


def prompt_error(message: str, req: _Common, max_tokens_given: bool) -> APIError:
    """The engine refused a prompt (ValueError): too long for max_model_len or the KV pool, ids outside the
    vocabulary, empty. A length problem names max_tokens when the body set it, else the prompt."""
    param = _prompt_field(req)
    named = message.split(" ", 1)[0].split("=", 1)[0]   # "n=10 is more ...", "stop_token_ids [..] are ..."
    if message.startswith("stop strings"):   # a model without a tokenizer cannot match stop strings
        param = "stop"
    elif named in ("n", "logprobs", "stop_token_ids", "stop") and named in type(req).model_fields:
        param = "top_logprobs" if named == "logprobs" and isinstance(req, ChatRequest) else named
    elif "max_tokens" in message and max_tokens_given:
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    return APIError(400, message, param=param)
