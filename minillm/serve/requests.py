"""One JSONL input line -> a request (prompt, sampling params, id), an abort command, or an error answer.

Shared by `generate` and `serve-stdin`. Nothing here touches the engine: checks that need the model (vocab range,
prompt length vs max_model_len) are the engine's, reported by add_request as ValueError.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, BinaryIO, Iterator

from minillm.sampling_params import SamplingParams
from minillm.structured.spec import SpecError, spec_from_request
from minillm.untrusted import TooNested, loads_json, short_repr

MAX_LINE_BYTES = 1 << 20   # 1 MiB: longer lines get a "line_too_long" answer and are skipped, never buffered
_READ_CHUNK = 1 << 16

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
PARAM_KEYS = tuple(f.name for f in fields(SamplingParams) if f.name != "structured")
STRUCTURED_KEYS = ("response_format", "structured_outputs")   # the HTTP server's fields, same meaning
ALLOWED_KEYS = ("id", *PROMPT_KEYS, *PARAM_KEYS, *STRUCTURED_KEYS, "priority", "enable_thinking")


@dataclass
class LineError(Exception):
    """A line that cannot be served. `id` is the line's own id when it had a usable one, else its line number."""
    id: Any
    type: str       # invalid_json | invalid_request | invalid_encoding | line_too_long | engine_error | ...
    message: str

    def to_json(self) -> dict:
        return {"id": self.id, "error": {"type": self.type, "message": self.message}}


@dataclass
class ParsedRequest:
    id: Any                                   # echoed back exactly as given (str or int), or the line number
    prompt: str | list[int] | list[dict]      # text, token ids, or chat messages
    params: SamplingParams
    priority: int = 0
    enable_thinking: bool | None = None       # chat template switch (Qwen3); only with messages


@dataclass
class AbortCommand:
    id: Any


@dataclass
class TooLong:
    """Stands in for a line over the size cap; its bytes were skipped, not kept."""
    size: int


def iter_lines(stream: BinaryIO, max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | TooLong]]:
    """Yield (1-based line number, raw bytes without the newline) or TooLong for an oversized line.

    Reads in chunks and drops the rest of an oversized line, so memory stays bounded and the next line is kept.
    """
    line_no, buf, dropped = 0, bytearray(), 0
    while True:
        chunk = stream.read1(_READ_CHUNK) if hasattr(stream, "read1") else stream.read(_READ_CHUNK)
        if not chunk:
            break
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            piece = chunk[start:] if nl < 0 else chunk[start:nl]
            if dropped or len(buf) + len(piece) > max_bytes:
                dropped += len(buf) + len(piece)
                buf.clear()
            else:
                buf += piece
            if nl < 0:
                break
            line_no += 1
            yield line_no, (TooLong(dropped) if dropped else bytes(buf))
            buf, dropped, start = bytearray(), 0, nl + 1
    if buf or dropped:
        line_no += 1
        yield line_no, (TooLong(dropped) if dropped else bytes(buf))


def write_line(stream: BinaryIO, obj: dict) -> None:
    """One JSON object per line, UTF-8, flushed at once so a reader sees every answer as it happens."""
    stream.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "replace") + b"\n")
    stream.flush()


def is_blank(raw: bytes | TooLong) -> bool:
    """Blank lines (e.g. a trailing empty line) carry no request and get no answer."""
    return isinstance(raw, bytes) and not raw.strip()


def decode_line(line_no: int, raw: bytes | TooLong) -> dict:
    """Bytes -> JSON object, or LineError (id = the line number, since the line's own id is unreadable)."""
    if isinstance(raw, TooLong):
        raise LineError(line_no, "line_too_long", f"line {line_no} is {raw.size} bytes; the limit is "
                        f"{MAX_LINE_BYTES} bytes")
    try:
        # A file saved by some editors starts with a byte-order mark; it is not part of the JSON.
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise LineError(line_no, "invalid_encoding", f"line {line_no} is not valid UTF-8 ({e.reason} at byte "
                        f"{e.start})") from None
    try:
        obj = loads_json(text)
    except TooNested as e:
        raise LineError(line_no, "invalid_json", f"line {line_no} is {e} (JSON depth limit)") from None
    except ValueError as e:   # JSONDecodeError, NaN/Infinity, an integer of more than 4,300 digits
        raise LineError(line_no, "invalid_json", f"line {line_no} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LineError(line_no, "invalid_request", f"line {line_no} must be a JSON object, got "
                        f"{type(obj).__name__}")
    return obj


def _request_id(obj: dict, line_no: int) -> Any:
    if "id" not in obj or obj["id"] is None:
        return line_no
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise LineError(line_no, "invalid_request", f"id must be a string or an integer, got {short_repr(rid)}")
    return rid


def _prompt(obj: dict, rid: Any) -> str | list[int] | list[dict]:
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        what = "none" if not given else ", ".join(given)
        raise LineError(rid, "invalid_request", f"give exactly one of prompt, messages, prompt_token_ids "
                        f"(got {what})")
    key = given[0]
    value = obj[key]
    if key == "prompt":
        ok = isinstance(value, str) and value != ""
        allowed = "a non-empty string"
    elif key == "prompt_token_ids":
        ok = isinstance(value, list) and value != [] and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        allowed = "a non-empty list of non-negative integers"
    else:
        ok = isinstance(value, list) and value != [] and all(_is_message(m) for m in value)
        allowed = 'a non-empty list of {"role": str, "content": str} objects'
    if not ok:
        raise LineError(rid, "invalid_request", f"{key} must be {allowed}, got {short_repr(value)}")
    return value


def _is_message(m: Any) -> bool:
    return (isinstance(m, dict) and set(m) <= {"role", "content"} and isinstance(m.get("role"), str)
            and m["role"] != "" and isinstance(m.get("content"), str))


def _params(obj: dict, rid: Any, defaults: dict) -> tuple[SamplingParams, int]:
    given = {k: obj[k] for k in PARAM_KEYS if k in obj}
    try:
        spec = spec_from_request(obj.get("response_format"), obj.get("structured_outputs"))
    except SpecError as e:
        raise LineError(rid, "invalid_request", str(e)) from None
    if spec is not None:
        given["structured"] = spec
    try:
        params = SamplingParams(**{**defaults, **given})
    except (ValueError, TypeError, OverflowError) as e:
        raise LineError(rid, "invalid_request", str(e)) from None
    priority = obj.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise LineError(rid, "invalid_request", f"priority must be an integer, got {short_repr(priority)}")
    return params, priority


def _check_finite(value: Any, rid: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise LineError(rid, "invalid_request", f"numbers must be finite, got {value}")


def parse_request(obj: dict, line_no: int, defaults: dict) -> ParsedRequest:
    """A decoded JSON object -> ParsedRequest, or LineError naming the offending field."""
    rid = _request_id(obj, line_no)
    unknown = sorted(set(obj) - set(ALLOWED_KEYS))
    if unknown:
        named = ", ".join(short_repr(k, 40) for k in unknown[:5]) + (f" and {len(unknown) - 5} more"
                                                                      if len(unknown) > 5 else "")
        raise LineError(rid, "invalid_request", f"unknown field(s) {named}; allowed: "
                        f"{', '.join(ALLOWED_KEYS)}")
    for value in obj.values():
        _check_finite(value, rid)
    prompt = _prompt(obj, rid)
    params, priority = _params(obj, rid, defaults)
    thinking = obj.get("enable_thinking")
    if thinking is not None and (not isinstance(thinking, bool) or "messages" not in obj):
        raise LineError(rid, "invalid_request", f"enable_thinking must be true or false and comes with messages, "
                        f"got {short_repr(thinking)}")
    return ParsedRequest(rid, prompt, params, priority, thinking)


def parse_line(line_no: int, raw: bytes | TooLong, defaults: dict, allow_abort: bool = False
               ) -> ParsedRequest | AbortCommand:
    """Everything between the raw bytes and a request; raises LineError with the id the answer must carry."""
    obj = decode_line(line_no, raw)
    if allow_abort and "abort" in obj:
        if set(obj) != {"abort"}:
            raise LineError(line_no, "invalid_request", 'an abort line is {"abort": ID} with no other fields')
        target = obj["abort"]
        if isinstance(target, bool) or not isinstance(target, (str, int)):
            raise LineError(line_no, "invalid_request", f"abort needs a string or integer id, got "
                            f"{short_repr(target)}")
        return AbortCommand(target)
    return parse_request(obj, line_no, defaults)
