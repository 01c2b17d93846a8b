#!/usr/bin/env python3
"""Validity of constrained outputs: on a model (default the demo model, CPU) at temperature 1.0, every output that
finishes with `stop` must parse and validate, and when a schema bounds its lengths at least 95% must finish with
`stop`. Cases: JSON schemas (nested objects, enums, bounded arrays and strings, numbers), json_object, regexes,
choices and tool sets (a required call, validated against the called tool's parameters).

Each case runs --count requests, seeds 0..count-1, max_tokens --max-tokens. One line per case, kind
"structured_validity", appended to --out: requests, stopped, stopped_valid, length, and whether the case's
lengths are bounded (the 95% target applies to those). A last line sums them.

Usage: python scripts/structured_validity.py [--count 8] [--max-tokens 200] [--out results/structured.jsonl]
       [--model DIR] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

from minillm.bench.report import append_jsonl  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.structured.spec import from_response_format, from_structured_outputs  # noqa: E402
from minillm.structured.tools import parse_tool_calls, parse_tools, tool_call_spec  # noqa: E402

S = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "flat_object": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 130}}, "required": ["name", "age"]},
    "nested_object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "email": S}, "required": ["id", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": ["S", "M", "L", "XL"]}},
              "required": ["color", "size"]},
    "bounded_array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                                                                                            "maxLength": 6},
                                                                "minItems": 1, "maxItems": 4}},
                      "required": ["tags"]},
    "numbers": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                                 "n": {"type": "integer", "minimum": -5, "maximum": 5}},
                "required": ["x", "n"]},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                                                                     "v": {"type": "integer",
                                                                                           "minimum": 0,
                                                                                           "maximum": 99}},
                                                    "required": ["k", "v"]}, "minItems": 1, "maxItems": 3},
}
REGEXES = {"date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "ipv4": r"([0-9]{1,3}\.){3}[0-9]{1,3}",
           "ident": r"[a-z_][a-z0-9_]{0,15}", "phone": r"\+[0-9]{2} [0-9]{3} [0-9]{4}"}
CHOICES = {"sentiment": ["positive", "negative", "neutral"], "yes_no": ["yes", "no"]}
TOOLSETS = {
    "weather_time": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}],
    "search": [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]}}}],
}


def cases():
    """(name, kind, bounded, prompt, spec, check(text) -> bool)"""
    for name, schema in SCHEMAS.items():
        spec = from_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        yield name, "json_schema", True, "Data:", spec, lambda t, s=schema: _valid_json(t, s)
    yield "json_object", "json_object", False, "JSON:", from_response_format({"type": "json_object"}), \
        lambda t: isinstance(_load(t), dict)
    for name, rx in REGEXES.items():
        yield name, "regex", True, "Value:", from_structured_outputs({"regex": rx}), \
            lambda t, r=rx: re.fullmatch(r, t) is not None
    for name, options in CHOICES.items():
        yield name, "choice", True, "Answer:", from_structured_outputs({"choice": options}), \
            lambda t, o=options: t in o
    for name, tools in TOOLSETS.items():
        parsed = parse_tools(tools)
        params = {t.name: t.parameters for t in parsed}
        yield name, "tools_required", True, [{"role": "user", "content": "Use a tool."}], tool_call_spec(parsed), \
            lambda t, p=params: _valid_call(t, p)


def _load(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _valid_json(text, schema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _valid_call(text, params) -> bool:
    content, calls = parse_tool_calls(text, set(params))
    if len(calls) != 1 or content is not None:
        return False
    fn = calls[0]["function"]
    return _valid_json(fn["arguments"], params[fn["name"]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", default="results/structured.jsonl")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=max(args.count, 8))
    totals = {"requests": 0, "stopped": 0, "stopped_valid": 0, "bounded_requests": 0, "bounded_stopped": 0}
    for name, kind, bounded, prompt, spec, check in cases():
        t0 = time.perf_counter()
        params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=s, structured=spec)
                  for s in range(args.count)]
        outs = [o.outputs[0] for o in llm.generate([prompt] * args.count, params, use_tqdm=False)]
        stopped = [c for c in outs if c.finish_reason == "stop"]
        valid = sum(check(c.text) for c in stopped)
        line = {"kind": "structured_validity", "engine": "minillm", "label": name, "constraint": kind,
                "bounded": bounded, "model": args.model or "demo", "device": args.device, "temperature": 1.0,
                "max_tokens": args.max_tokens, "requests": len(outs), "stopped": len(stopped),
                "stopped_valid": valid, "length": sum(c.finish_reason == "length" for c in outs),
                "mean_tokens": sum(len(c.token_ids) for c in outs) / len(outs),
                "wall_s": round(time.perf_counter() - t0, 2), "example": outs[0].text[:120]}
        append_jsonl(args.out, line)
        print(f"{name:18s} {kind:14s} stop {len(stopped)}/{len(outs)} valid {valid}/{len(stopped)}")
        totals["requests"] += len(outs)
        totals["stopped"] += len(stopped)
        totals["stopped_valid"] += valid
        if bounded:
            totals["bounded_requests"] += len(outs)
            totals["bounded_stopped"] += len(stopped)
    totals["valid_fraction_of_stopped"] = totals["stopped_valid"] / max(totals["stopped"], 1)
    totals["stop_fraction_bounded"] = totals["bounded_stopped"] / max(totals["bounded_requests"], 1)
    append_jsonl(args.out, {"kind": "structured_validity_summary", "engine": "minillm", "label": "all",
                            "model": args.model or "demo", "device": args.device, **totals})
    print(json.dumps(totals))


if __name__ == "__main__":
    main()
