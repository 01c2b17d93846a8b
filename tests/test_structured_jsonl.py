"""JSONL request lines (`minillm generate`; `serve-stdin` parses lines the same way) take response_format and
structured_outputs with the HTTP meaning; bad ones are answered with an invalid_request line naming the field,
and the other lines are still served."""
import json
import re

import jsonschema
from typer.testing import CliRunner

from minillm.commands import app

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}}, "required": ["k", "v"]}
LINES = [
    {"id": "schema", "prompt": "Data:", "temperature": 1.0, "seed": 1, "max_tokens": 40,
     "response_format": {"type": "json_schema", "json_schema": {"name": "kv", "schema": SCHEMA}}},
    {"id": "choice", "prompt": "Answer:", "temperature": 1.0, "seed": 2, "max_tokens": 10,
     "structured_outputs": {"choice": ["yes", "no"]}},
    {"id": "regex", "prompt": "Code:", "temperature": 1.0, "seed": 3, "max_tokens": 20,
     "structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}},
    {"id": "free", "prompt": "Code:", "temperature": 1.0, "seed": 3, "max_tokens": 20},
    {"id": "bad_regex", "prompt": "x", "structured_outputs": {"regex": "(ab"}},
    {"id": "empty_choice", "prompt": "x", "structured_outputs": {"choice": []}},
    {"id": "bad_type", "prompt": "x", "response_format": {"type": "xml"}},
]


def test_generate_lines_with_constraints(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    result = CliRunner().invoke(app, ["generate", str(src), "--device", "cpu"])
    answers = {a["id"]: a for a in (json.loads(t) for t in result.output.splitlines() if t.startswith('{"id"'))}
    jsonschema.validate(json.loads(answers["schema"]["text"]), SCHEMA)
    assert answers["choice"]["text"] in ("yes", "no")
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", answers["regex"]["text"])
    assert not re.fullmatch("[A-Z]{2}[0-9]{2}", answers["free"]["text"])   # the constraint does the work
    for rid, field in (("bad_regex", "structured_outputs.regex"), ("empty_choice", "structured_outputs.choice"),
                       ("bad_type", "response_format.type")):
        assert answers[rid]["error"]["type"] == "invalid_request" and field in answers[rid]["error"]["message"]
