"""`minillm generate`: JSONL requests in, one JSONL answer per request line out, in input order.

The input streams through a bounded window: a reader thread hands lines over as they arrive (stdin is read
incrementally, and a slow writer never stalls the engine), at most `window` lines are admitted and not yet
written at any time, and answers are written as soon as every earlier line has its answer. Memory therefore
stays bounded however long the input is, and a pipe sees its first answers before its input ends. A bad line
gets its error answer and takes no engine state.

SIGINT or SIGTERM ends the run early without losing a line: requests in flight are aborted and answered with
what they have so far (finish_reason "abort"); lines not yet started get an "interrupted" error answer (every
remaining line of a file; of a pipe, the lines already read, since its writer may never close it). If the output
cannot be written (disk full, a closed pipe), the run stops at once and the error is reported.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterable

from minillm.progress import TokenProgress
from minillm.serve.requests import LineError, TooLong, parse_line, write_line
from minillm.serve.shutdown import StopSignals

MIN_WINDOW = 64
WINDOW_PER_SEQ = 4
_POLL_S = 0.2   # how often a run waiting for input looks at the stop flag
_EOF = object()


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


NEG_INF_LOGPROB = -9999.0   # what -inf (a token with probability 0) is written as: JSON has no infinities


def json_logprob(value: float) -> float | None:
    """A logprob as JSON can hold it: -inf as NEG_INF_LOGPROB (vLLM's sentinel), NaN (logits that were NaN or
    inf, which the engine warns about) as null. Plain JSON never sees a bare NaN or Infinity."""
    if math.isfinite(value):
        return value
    return NEG_INF_LOGPROB if value == -math.inf else None


def logprobs_json(lps) -> list[dict] | None:
    if lps is None:
        return None
    return [{"token_id": lp.token_id, "logprob": json_logprob(lp.logprob),
             "top": {str(k): json_logprob(v) for k, v in lp.top.items()}} for lp in lps]


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

    def __init__(self, stream: BinaryIO, summary: Summary, on_answer):
        self.stream, self.pending, self.next, self.summary = stream, {}, 0, summary
        self.on_answer = on_answer   # progress callback, given the answer's output token count
        self.error: OSError | None = None

    def put(self, slot: int, answer: dict) -> None:
        self.pending[slot] = answer
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
        while self.error is None and self.next in self.pending:
            try:
                write_line(self.stream, self.pending[self.next])
            except OSError as e:   # ENOSPC, EPIPE (a reader such as `head -1` went away), EIO, ...
                self.error = e
                return
            del self.pending[self.next]   # written: a big run keeps only the window's answers
            self.next += 1


class _Feed:
    """The input lines, read by a daemon thread into a queue of at most `size` lines: reading never blocks the
    engine, and a fast input never runs ahead of the window by more than the queue."""

    def __init__(self, lines: Iterable, size: int):
        self.queue: queue.Queue = queue.Queue(maxsize=size)
        self.done = False   # the end of the input was taken off the queue
        threading.Thread(target=self._read, args=(lines,), daemon=True, name="generate-reader").start()

    def _read(self, lines: Iterable) -> None:
        try:
            for item in lines:
                self.queue.put(item)
        except (OSError, ValueError) as e:   # the input failed under us: answer it, then end as at EOF
            self.queue.put((0, e))
        self.queue.put(_EOF)

    def get(self, block: bool):
        """The next (line number, raw) item, or None when none arrived (at once, or within _POLL_S)."""
        try:
            item = self.queue.get(timeout=_POLL_S) if block else self.queue.get_nowait()
        except queue.Empty:
            return None
        if item is _EOF:
            self.done = True
            return None
        return item


class _Run:
    """One streamed run: admit from the feed while the window has room, step, write what finished."""

    def __init__(self, llm, feed: _Feed, defaults: dict, writer: _OrderedWriter, stop: StopSignals, window: int,
                 finite: bool):
        self.llm, self.feed, self.defaults, self.writer, self.stop = llm, feed, defaults, writer, stop
        self.window, self.finite = window, finite
        self.admitted: dict[str, tuple[int, Any]] = {}   # engine id -> (slot, user id), until its answer
        self.slots = 0                                    # lines taken so far
        self.aborted = False

    def loop(self) -> None:
        while True:
            if not self.aborted and (self.stop.requested or self.writer.error is not None):
                for eid in list(self.admitted):   # reported, with the text so far, by the next step
                    self.llm.abort(eid)
                self.aborted = True
            self._take()
            if self.llm.has_unfinished_requests():
                self._step()
            elif self._input_over():
                return

    def _input_over(self) -> bool:
        if self.feed.done or self.writer.error is not None:
            return True
        # Stopped, reading a pipe: the lines already read are answered; its writer may never close it.
        return self.stop.requested and not self.finite and self.feed.queue.empty()

    def _take(self) -> None:
        """Admit lines while the window has room; wait for one only when there is nothing to step."""
        while not self.feed.done and self.writer.error is None and self.slots - self.writer.next < self.window:
            stopped_pipe = self.stop.requested and not self.finite
            block = not self.llm.has_unfinished_requests() and not stopped_pipe
            item = self.feed.get(block)
            if item is None:
                return
            self._admit(self.slots, *item)
            self.slots += 1

    def _admit(self, slot: int, line_no: int, raw) -> None:
        rid = line_no
        try:
            if isinstance(raw, Exception):
                raise LineError(line_no, "read_error", f"reading the input failed: {raw}")
            req = parse_line(line_no, raw, self.defaults)
            rid = req.id
            if self.stop.requested or self.writer.error is not None:
                raise LineError(rid, "interrupted", f"not started: the run was stopped ({self._why()})")
            # The engine id is the line number: user ids may repeat or collide; line numbers cannot.
            eid = self.llm.add_request(req.prompt, req.params, request_id=str(line_no), priority=req.priority,
                                       enable_thinking=req.enable_thinking)
        except LineError as e:
            self.writer.put(slot, e.to_json())
        except ValueError as e:   # the engine's verdict: too long for max_model_len, ids outside the vocab, ...
            self.writer.put(slot, LineError(rid, "invalid_request", str(e)).to_json())
        except Exception as e:  # noqa: BLE001 - one line's unexpected failure must not cost the others theirs
            self.writer.put(slot, LineError(rid, "engine_error", f"{type(e).__name__}: {e}").to_json())
        else:
            self.admitted[eid] = (slot, rid)

    def _why(self) -> str:
        return self.stop.name if self.stop.requested else f"output failed: {self.writer.error}"

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as e:  # noqa: BLE001 - an engine failure must still answer every line it was serving
            for eid, (slot, rid) in sorted(self.admitted.items(), key=lambda kv: kv[1][0]):
                self.writer.put(slot, LineError(rid, "engine_error", f"{type(e).__name__}: {e}").to_json())
                self.llm.abort(eid)
            self.admitted.clear()
            return
        for so in outputs:
            if so.output is not None and so.request_id in self.admitted:
                slot, rid = self.admitted.pop(so.request_id)
                self.writer.put(slot, answer_json(rid, so.output))


def default_window(llm) -> int:
    """Lines admitted and not yet written: a few per sequence the engine can run, so its waiting queue stays
    full while earlier answers wait for a slow line."""
    return max(MIN_WINDOW, WINDOW_PER_SEQ * llm.config.scheduler.max_num_seqs)


def run_generate(llm, lines: Iterable[tuple[int, bytes | TooLong]], defaults: dict, out: BinaryIO,
                 progress: bool = True, total: int | None = None, window: int | None = None,
                 finite: bool = True) -> Summary:
    """Serve every (line number, raw line) of `lines` (any iterable, read as it goes) and write one answer per
    line to `out` (binary, flushed per line). total: the line count for the progress bar, when known. finite:
    the input ends by itself (a file), so a stopped run still answers every remaining line."""
    summary = Summary()
    start = time.perf_counter()
    window = window or default_window(llm)
    with TokenProgress(total, progress) as advance, StopSignals() as stop:
        writer = _OrderedWriter(out, summary, advance)
        _Run(llm, _Feed(lines, window), defaults, writer, stop, window, finite).loop()
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
