"""`minillm generate`: JSONL requests in, one JSONL answer per request line out, in input order.

All lines are parsed and admitted first (a bad one gets its error answer and takes no engine state), then the
engine steps until every admitted request has finished. Answers are written as soon as every earlier line has
its answer, so a long run streams its results in order.

SIGINT or SIGTERM ends the run early without losing a line: requests in flight are aborted and answered with
what they have so far (finish_reason "abort"), lines not yet admitted get an "interrupted" error answer. If the
output cannot be written (disk full, a closed pipe), the run stops at once and the error is reported.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from minillm.progress import TokenProgress
from minillm.serve.requests import LineError, TooLong, parse_line, write_line
from minillm.serve.shutdown import StopSignals


@dataclass
class Summary:
    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)   # error type -> count
    stopped_by: StopSignals | None = None   # a SIGINT / SIGTERM ended the run early
    write_error: OSError | None = None      # the output could not be written; answers from there on are lost

    @property
    def exit_code(self) -> int:
        if self.stopped_by is not None and self.stopped_by.requested:
            return self.stopped_by.exit_code
        return 0 if self.failed == 0 and self.write_error is None else 1


def usage(out) -> dict:
    return {"prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": sum(len(c.token_ids) for c in out.outputs)}


def logprobs_json(lps) -> list[dict] | None:
    if lps is None:
        return None
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": {str(k): v for k, v in lp.top.items()}}
            for lp in lps]


def answer_json(rid: Any, out) -> dict:
    """A finished RequestOutput -> the documented answer line; n > 1 adds every completion under "outputs"."""
    line = {"id": rid, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "usage": usage(out)}
    if out.logprobs is not None:
        line["logprobs"] = logprobs_json(out.logprobs)
    if len(out.outputs) > 1:
        line["outputs"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason, "logprobs": logprobs_json(c.logprobs)}
                           for c in out.outputs]
    return line


class _OrderedWriter:
    """Holds answers by slot and writes the longest finished prefix, so output order = input order.
    A failed write is kept in `error`; nothing more is written after it."""

    def __init__(self, stream: BinaryIO, n: int, summary: Summary, on_answer):
        self.stream, self.answers, self.next, self.summary = stream, [None] * n, 0, summary
        self.on_answer = on_answer   # progress callback, given the answer's output token count
        self.error: OSError | None = None

    def put(self, slot: int, answer: dict) -> None:
        self.answers[slot] = answer
        if "error" in answer:
            self.summary.failed += 1
            kind = answer["error"]["type"]
            self.summary.errors[kind] = self.summary.errors.get(kind, 0) + 1
            self.on_answer(0)
        else:
            self.summary.ok += 1
            self.summary.prompt_tokens += answer["usage"]["prompt_tokens"]
            self.summary.completion_tokens += answer["usage"]["completion_tokens"]
            self.on_answer(answer["usage"]["completion_tokens"])
        while self.error is None and self.next < len(self.answers) and self.answers[self.next] is not None:
            try:
                write_line(self.stream, self.answers[self.next])
            except OSError as e:   # ENOSPC, EPIPE (a reader such as `head -1` went away), EIO, ...
                self.error = e
                return
            self.answers[self.next] = None   # written: drop it, a big run need not keep every answer
            self.next += 1


def _admit(llm, lines, defaults: dict, writer: _OrderedWriter, stop: StopSignals) -> dict[str, tuple[int, Any]]:
    """Parse and add every line; returns engine request id -> (slot, user id) for the admitted ones."""
    admitted = {}
    for slot, (line_no, raw) in enumerate(lines):
        rid = line_no
        try:
            req = parse_line(line_no, raw, defaults)
            rid = req.id
            if stop.requested or writer.error is not None:
                raise LineError(rid, "interrupted", f"not started: the run was stopped ({_why(stop, writer)})")
            # The engine id is the line number: user ids may repeat or collide; line numbers cannot.
            eid = llm.add_request(req.prompt, req.params, request_id=str(line_no), priority=req.priority,
                                  enable_thinking=req.enable_thinking)
        except LineError as e:
            writer.put(slot, e.to_json())
        except ValueError as e:   # the engine's verdict: too long for max_model_len, ids outside the vocab, ...
            writer.put(slot, LineError(rid, "invalid_request", str(e)).to_json())
        except Exception as e:  # noqa: BLE001 - one line's unexpected failure must not cost the others theirs
            writer.put(slot, LineError(rid, "engine_error", f"{type(e).__name__}: {e}").to_json())
        else:
            admitted[eid] = (slot, rid)
    return admitted


def _why(stop: StopSignals, writer: _OrderedWriter) -> str:
    return stop.name if stop.requested else f"output failed: {writer.error}"


def _run(llm, admitted: dict, writer: _OrderedWriter, stop: StopSignals) -> None:
    aborted = False
    try:
        while llm.has_unfinished_requests():
            if not aborted and (stop.requested or writer.error is not None):
                _abort_all(llm, admitted)
                aborted = True
            for so in llm.step():
                if so.output is not None and so.request_id in admitted:
                    slot, rid = admitted.pop(so.request_id)
                    writer.put(slot, answer_json(rid, so.output))
    except Exception as e:  # noqa: BLE001 - an engine failure must still answer every line it was serving
        for eid, (slot, rid) in sorted(admitted.items(), key=lambda kv: kv[1][0]):
            writer.put(slot, LineError(rid, "engine_error", f"{type(e).__name__}: {e}").to_json())
            llm.abort(eid)
        admitted.clear()


def _abort_all(llm, admitted: dict) -> None:
    """Abort what is still running; the engine reports each abort (with the text so far) on its next step."""
    for eid in list(admitted):
        llm.abort(eid)


def run_generate(llm, lines: list[tuple[int, bytes | TooLong]], defaults: dict, out: BinaryIO,
                 progress: bool = True) -> Summary:
    """Serve every (line number, raw line) and write one answer per line to `out` (binary, flushed per line)."""
    summary = Summary()
    start = time.perf_counter()
    with TokenProgress(len(lines), progress) as advance, StopSignals() as stop:
        writer = _OrderedWriter(out, len(lines), summary, advance)
        _run(llm, _admit(llm, lines, defaults, writer, stop), writer, stop)
    summary.seconds = time.perf_counter() - start
    summary.stopped_by, summary.write_error = stop, writer.error
    return summary


def summary_table(summary: Summary):
    """The end-of-run table (printed on stderr by the CLI)."""
    from rich.table import Table
    table = Table(title="generate", show_header=False)
    tps = summary.completion_tokens / summary.seconds if summary.seconds > 0 else 0.0
    rows = [("requests ok", f"{summary.ok}"), ("requests failed", f"{summary.failed}"),
            ("prompt tokens", f"{summary.prompt_tokens}"), ("output tokens", f"{summary.completion_tokens}"),
            ("wall time", f"{summary.seconds:.2f} s"), ("output tokens/s", f"{tps:,.1f}")]
    rows += [(f"  errors: {kind}", f"{n}") for kind, n in sorted(summary.errors.items())]
    for name, value in rows:
        table.add_row(name, value)
    return table
