"""OpenAI function tools in the Qwen3 (hermes) style: checking `tools` and `tool_choice`, the grammar that
constrains a `required` or named call, chat prompts that carry tools, and parsing `<tool_call>` blocks out of
generated text (whole, or as a stream).

Qwen3 writes one call as  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>  and several as such
blocks one after another. A constrained call (tool_choice required or named) is exactly one block whose name is
one of the allowed tools and whose arguments match that tool's `parameters` schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from minillm.structured.spec import GrammarSpec, SpecError, canonical_json, check_schema
from minillm.untrusted import short_repr

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(tools: Any) -> list[Tool]:
    """OpenAI `tools` -> Tools, or SpecError(param="tools")."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise SpecError("tools", f"tools must be a list of function tools, got {short_repr(tools)}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise SpecError("tools", f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}, got "
                            f"{short_repr(t)}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise SpecError("tools", f"{where}.function.name must be 1-64 letters, digits, _ . or -, got "
                            f"{short_repr(name)}")
        if name in seen:
            raise SpecError("tools", f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters", _EMPTY_PARAMS)
        if params is None:
            params = _EMPTY_PARAMS
        check_schema(params, f"{where}.function.parameters")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise SpecError("tools", f"{where}.function.description must be a string")
        out.append(Tool(name, desc, params))
    return out


def resolve_tool_choice(choice: Any, tools: list[Tool]) -> tuple[str, list[Tool]]:
    """-> (mode, the tools a call may name): mode is none | auto | forced. SpecError(param="tool_choice")."""
    if choice is None:
        return ("auto", tools) if tools else ("none", [])
    if choice == "none":
        return "none", []
    if choice in ("auto", "required"):
        if not tools:
            raise SpecError("tool_choice", f"tool_choice {choice!r} needs a non-empty tools list")
        return ("auto" if choice == "auto" else "forced"), tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = [t for t in tools if t.name == name]
        if not named:
            known = ", ".join(t.name for t in tools) or "none"
            raise SpecError("tool_choice", f"tool_choice names the function {short_repr(name)}, which is not in "
                            f"tools (known: {known})")
        return "forced", named
    raise SpecError("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", "
                    f"\"function\": {{\"name\": ...}}}}, got {short_repr(choice)}")


def tool_call_spec(tools: list[Tool]) -> GrammarSpec:
    """The constraint of a forced call: one block naming one of `tools`."""
    return GrammarSpec("tool_call", canonical_json([{"name": t.name, "parameters": t.parameters} for t in tools]),
                       "tools")


def tool_call_grammar(items: list[dict], json_options: dict):
    """xgrammar Grammar for  <tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>  over the given tools."""
    import xgrammar as xgr

    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": it["name"]},
                                                           "arguments": it["parameters"]},
                         "required": ["name", "arguments"]} for it in items]}
    body = xgr.Grammar.from_json_schema(json.dumps(schema), **json_options)
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(OPEN + chr(10))}"), body,
                              xgr.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + CLOSE)}"))


# ---- prompts ------------------------------------------------------------------------------------------------

def chat_with_tools(messages: list[dict], tools: list[dict] | None, template: str | None):
    """-> (messages, tools to pass to the template). A template that renders `tools` itself (Qwen3's) gets them
    as they are; for one that does not, the tools go into a system block and earlier calls and tool results
    into the text, in the form Qwen3's template would have written them."""
    if template is not None and "tools" in template:
        return [_template_message(m) for m in messages], tools
    out = [_text_message(m) for m in messages]
    if tools:
        block = _tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _template_message(m: dict) -> dict:
    m = dict(m)
    if m.get("content") is None:
        m["content"] = ""
    if m.get("tool_calls"):
        m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                           for c in m["tool_calls"]]
    return m


def _text_message(m: dict) -> dict:
    content = m.get("content") or ""
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = [call_text(c["function"]["name"], _arguments(c["function"])) for c in m.get("tool_calls") or []]
    return {"role": m["role"], "content": "\n".join(([content] if content else []) + calls)}


def _arguments(fn: dict) -> Any:
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def call_text(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def _tools_block(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"The functions you can call are listed in <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            f"{OPEN}{CLOSE} tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
            f"{CLOSE}")


# ---- parsing ------------------------------------------------------------------------------------------------

def new_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _parse_block(inner: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    return new_call(obj["name"], args)


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """-> (the text outside valid call blocks, or None if empty; the calls). A block that does not parse, or
    names an unknown tool, stays in the text."""
    calls, content, last = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1), names)
        if call is None:
            continue
        content.append(text[last:m.start()])
        calls.append(call)
        last = m.end()
    content.append(text[last:])
    rest = "".join(content).strip() if calls else "".join(content)
    return (rest or None), calls


class ToolCallStream:
    """Text deltas of one choice -> (content delta, finished calls). Text that may start a call block is held
    back until it is known not to; a block is sent as one tool-call delta once it closes."""

    def __init__(self, names: set[str]):
        self.names, self.buf, self.calls = names, "", 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        out, calls = [], []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buf, OPEN)
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(CLOSE, start)
            if end < 0:
                out.append(self.buf[:start])
                self.buf = self.buf[start:]
                break
            call = _parse_block(self.buf[start + len(OPEN):end], self.names)
            piece = self.buf[:end + len(CLOSE)]
            if call is None:
                out.append(piece)
            else:
                out.append(self.buf[:start].rstrip("\n") if self.calls == 0 else "")
                calls.append(call)
                self.calls += 1
            self.buf = self.buf[end + len(CLOSE):]
            if self.calls:
                self.buf = self.buf.lstrip("\n")
        return "".join(out), calls

    def finish(self) -> str:
        rest, self.buf = self.buf, ""
        return rest


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0
