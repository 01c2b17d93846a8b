"""The SSE encoder of `minillm serve` (minillm/serve/http/formatting.py): the JSON json.dumps would write, in
less time."""
import json

from minillm.serve.http.formatting import DONE, sse


def test_sse_events_are_the_json_of_json_dumps():
    objs = [{"id": "cmpl-1", "choices": [{"index": 0, "text": "é\u2028\x00\x1f\"\\ 😀\n", "logprobs": None,
                                          "finish_reason": None, "token_ids": [5, 6]}], "usage": None},
            {"logprobs": {"token_logprobs": [-9999.0, 1e-05, -0.0, 2.5e-7], "top_logprobs": [{"a": -1.5}]}},
            {"error": {"message": "engine step failed", "type": "server_error", "param": None, "code": None}}]
    for obj in objs:
        event = sse(obj)
        assert event.startswith("data: {") and event.endswith("}\n\n") and "\n" not in event[:-2]
        assert json.loads(event[6:]) == obj
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        if "logprobs" not in obj:   # no floats: byte for byte what json.dumps writes
            assert event == f"data: {text}\n\n"
    assert DONE == "data: [DONE]\n\n"
