"""What a request asks its output to match, as plain data: a GrammarSpec is (kind, text), hashable (the compile
cache's key) and picklable (it crosses the scheduler/runner contract inside SamplingParams).

The request shapes that produce one, each checked here with a message naming the parameter:
- OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}
- vLLM's `structured_outputs`: exactly one of {"json": schema}, {"regex": str}, {"choice": [str, ...]},
  {"grammar": EBNF} (or {"json_object": true})
- tool calling: a tool-call grammar built by minillm/structured/tools.py (kind "tool_call")

What only the grammar library can judge (a regex that does not parse, EBNF with a syntax error, a schema feature
it does not support) is refused when the spec compiles (minillm/structured/compiler.py), with the same `param`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from minillm.untrusted import short_repr

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_call")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class SpecError(ValueError):
    """A structured-output parameter is wrong; `param` names it as the request spelled it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    kind: str                       # one of KINDS
    text: str                       # canonical JSON of a schema / choice list / tool set, or the regex / EBNF
    param: str = field(default="structured_outputs", compare=False)   # where it came from, for error messages

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecError(self.param, f"{self.param}: unknown constraint kind {self.kind!r}")
        if not isinstance(self.text, str):
            raise SpecError(self.param, f"{self.param} must be text, got {type(self.text).__name__}")


def canonical_json(value: Any) -> str:
    """One text per JSON value (no spaces; key order kept: it is the order properties are generated in)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def check_schema(schema: Any, param: str) -> None:
    """A JSON schema must be an object (or true) that its own metaschema accepts."""
    if schema is True:
        return
    if not isinstance(schema, dict):
        raise SpecError(param, f"{param} must be a JSON schema object, got {short_repr(schema)}")
    import jsonschema   # only requests that carry a schema pay for the import

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise SpecError(param, f"{param} is not a valid JSON schema{' at ' + where if where else ''}: "
                        f"{short_repr(e.message, 200)}") from None


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    if isinstance(schema, str):   # vLLM accepts the schema as JSON text too
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SpecError(param, f"{param} is not valid JSON: {e}") from None
    check_schema(schema, param)
    return GrammarSpec("json", canonical_json(schema), param)


def from_response_format(rf: Any, param: str = "response_format") -> GrammarSpec | None:
    """OpenAI's response_format -> a spec, or None for plain text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise SpecError(param, f"{param} must be an object with a \"type\", got {short_repr(rf)}")
    kind = rf.get("type")
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise SpecError(param, f"{param}: unknown key(s) {', '.join(map(repr, extra))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise SpecError(param, f"{param}.json_schema must be an object with a \"schema\" "
                            f"(and optionally \"name\", \"strict\"), got {short_repr(js)}")
        unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
        if unknown:
            raise SpecError(param, f"{param}.json_schema: unknown key(s) {', '.join(map(repr, unknown))}")
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise SpecError(param, f"{param}.json_schema.name must be a string")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise SpecError(param, f"{param}.json_schema.strict must be true or false")
        return json_schema_spec(js["schema"], f"{param}.json_schema.schema")
    raise SpecError(param, f"{param}.type must be one of text, json_object, json_schema; got {short_repr(kind)}")


def from_structured_outputs(so: Any, param: str = "structured_outputs") -> GrammarSpec | None:
    """vLLM's structured_outputs -> a spec (exactly one constraint), or None when it is null or empty."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise SpecError(param, f"{param} must be an object, got {short_repr(so)}")
    unknown = sorted(set(so) - set(STRUCTURED_KEYS))
    if unknown:
        raise SpecError(param, f"{param}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                        f"{', '.join(STRUCTURED_KEYS)}")
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise SpecError(param, f"{param} takes one constraint, got {', '.join(given)}")
    key = given[0]
    value, where = so[key], f"{param}.{key}"
    if key == "json":
        return json_schema_spec(value, where)
    if key == "json_object":
        if value is not True:
            raise SpecError(where, f"{where} must be true, got {short_repr(value)}")
        return GrammarSpec("json_object", "", where)
    if key == "choice":
        if not isinstance(value, list) or not value:
            raise SpecError(where, f"{where} must be a non-empty list of strings, got {short_repr(value)}")
        if not all(isinstance(c, str) and c for c in value):
            raise SpecError(where, f"{where} must hold non-empty strings only, got {short_repr(value)}")
        return GrammarSpec("choice", canonical_json(value), where)
    if not isinstance(value, str) or not value:   # regex, grammar
        raise SpecError(where, f"{where} must be a non-empty string, got {short_repr(value)}")
    return GrammarSpec(key, value, where)


def spec_from_request(response_format: Any = None, structured_outputs: Any = None) -> GrammarSpec | None:
    """The one constraint of a request that may carry either field (both at once is refused)."""
    a = from_response_format(response_format)
    b = from_structured_outputs(structured_outputs)
    if a is not None and b is not None:
        raise SpecError("structured_outputs", "give response_format or structured_outputs, not both")
    return a or b
