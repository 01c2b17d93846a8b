"""`minillm serve-stdin`: request lines arrive on stdin while the engine runs; events stream out as JSON lines.

A reader thread turns stdin into (line number, raw bytes) items on a queue, so a slow or silent client never
stalls generation. The main thread owns the engine: it admits whatever has arrived, steps while work exists, and
blocks on the queue only when idle. Events per request:

    {"id", "event": "token", "text": delta, "token_ids": [...]}        zero or more (n > 1 adds "index")
    {"id", "event": "done", "finish_reason", "usage", "metrics": {"ttft_s", "itl_s"}}   exactly one, or
    {"id", "event": "error", "error": {"type", "message"}}              exactly one instead of "done"

`{"abort": ID}` aborts a request in flight (its "done" event has finish_reason "abort"). At EOF the requests in
flight finish and the server exits 0; SIGINT or SIGTERM aborts them all, emits their final events, and exits
130 or 143. If stdout goes away (the reader closed the pipe), the server aborts everything and exits 1 quietly.
If the engine-core process dies (parallel.engine_process), every request in flight gets an engine_error event
and the server stops (`fatal` says why; the command exits 1).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, BinaryIO

from minillm.engine.core_client import EngineDeadError, RequestsFailed
from minillm.serve.generate_jsonl import logprobs_json, usage
from minillm.serve.requests import AbortCommand, LineError, is_blank, iter_lines, parse_line, write_line
from minillm.serve.shutdown import StopSignals
from minillm.untrusted import short_repr

_EOF = object()
_IDLE_POLL_S = 0.5   # how often an idle server wakes up, so a signal is seen promptly on every platform


def _reader(stream: BinaryIO, q: queue.Queue, wake) -> None:
    """wake(): a step() waiting on an engine process returns, so the line is admitted at once."""
    try:
        for item in iter_lines(stream):
            q.put(item)
            wake()
    except (OSError, ValueError) as e:   # stdin closed under us: treat like EOF, after saying why
        q.put((0, e))
    q.put(_EOF)
    wake()


class StdinServer:
    def __init__(self, llm, defaults: dict, out: BinaryIO):
        self.llm, self.defaults, self.out = llm, defaults, out
        self.inflight: dict[str, tuple[Any, int]] = {}   # engine id -> (user id, n), until its final event
        self.by_user: dict[Any, str] = {}    # user id -> engine id (abort lines name the user id)
        self.eof = False
        self.stop = StopSignals()
        self.write_error: OSError | None = None   # stdout failed (closed pipe, full disk): stop serving
        self.fatal: str | None = None             # the engine process died: stop serving

    # ---- input ----------------------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self.stop.requested or self.write_error is not None or self.fatal is not None

    def _write(self, event: dict) -> None:
        if self.write_error is not None:
            return
        try:
            write_line(self.out, event)
        except OSError as e:
            self.write_error = e

    def _check_engine(self) -> None:
        try:
            self.llm.check_engine()
        except EngineDeadError as e:
            self.fatal = str(e)

    def _handle(self, line_no: int, raw) -> None:
        if isinstance(raw, Exception):
            self._write(LineError(line_no, "read_error", f"stdin failed: {raw}").to_json())
            return
        if is_blank(raw):
            return
        try:
            item = parse_line(line_no, raw, self.defaults, allow_abort=True)
            if isinstance(item, AbortCommand):
                self._abort(item.id)
                return
            if item.id in self.by_user:
                raise LineError(item.id, "invalid_request", f"id {short_repr(item.id)} is already in flight")
            eid = self.llm.add_request(item.prompt, item.params, request_id=str(line_no), priority=item.priority,
                                       enable_thinking=item.enable_thinking)
        except LineError as e:
            self._error(e)
        except ValueError as e:   # the engine refused it (too long, ids outside the vocab, ...)
            self._error(LineError(item.id, "invalid_request", str(e)))
        except Exception as e:  # noqa: BLE001 - one line's unexpected failure must not end the server
            self._error(LineError(item.id, "engine_error", f"{type(e).__name__}: {e}"))
        else:
            self.inflight[eid] = (item.id, item.params.n)
            self.by_user[item.id] = eid

    def _abort(self, user_id: Any) -> None:
        eid = self.by_user.get(user_id)
        if eid is None or not self.llm.abort(eid):
            self._error(LineError(user_id, "unknown_id", f"no request with id {short_repr(user_id)} is in flight"))
        # The engine emits the aborted request's final StepOutput on the next step().

    def _error(self, err: LineError) -> None:
        line = err.to_json()
        self._write({"id": line["id"], "event": "error", "error": line["error"]})

    def _drain(self, block: bool) -> None:
        """Admit every line that has arrived; when `block`, wait (in short polls) for at least one."""
        while not self.stopping:
            try:
                item = self.queue.get(timeout=_IDLE_POLL_S) if block else self.queue.get_nowait()
            except queue.Empty:
                if block:
                    self._check_engine()
                    continue
                return
            block = False
            if item is _EOF:
                self.eof = True
                return
            self._handle(*item)

    # ---- output ---------------------------------------------------------------------------------------
    def _emit(self, so) -> None:
        if so.request_id not in self.inflight:
            return
        rid, n = self.inflight[so.request_id]
        if so.new_token_ids or so.new_text:
            event = {"id": rid, "event": "token", "text": so.new_text, "token_ids": so.new_token_ids}
            if n > 1:
                event["index"] = so.index
            self._write(event)
        if so.output is not None:   # the whole request (all n completions) has finished
            self._write(self._done(rid, so.output))
            del self.inflight[so.request_id]
            del self.by_user[rid]

    @staticmethod
    def _done(rid: Any, out) -> dict:
        m = out.metrics
        event = {"id": rid, "event": "done", "finish_reason": out.finish_reason, "usage": usage(out),
                 "metrics": {"ttft_s": m.ttft if m else None, "itl_s": m.itls if m else []}}
        if out.logprobs is not None:
            event["logprobs"] = logprobs_json(out.logprobs)
        if len(out.outputs) > 1:
            event["outputs"] = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
                                for c in out.outputs]
        return event

    # ---- loop -----------------------------------------------------------------------------------------
    def serve(self, stream: BinaryIO) -> int:
        """Run until EOF and every request has its final event (0), until SIGINT / SIGTERM (130 / 143), or
        until stdout fails (1)."""
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(stream, self.queue, self.llm.wake), daemon=True,
                         name="stdin-reader").start()
        with self.stop:
            self._loop()
            if self.stopping:
                self._abort_all()
        if self.stop.requested:
            return self.stop.exit_code
        return 1 if self.write_error is not None or self.fatal is not None else 0

    def _loop(self) -> None:
        while not self.stopping and not (self.eof and not self.llm.has_unfinished_requests()):
            if not self.eof:
                self._drain(block=not self.llm.has_unfinished_requests())
            if self.llm.has_unfinished_requests() and not self.stopping:
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except EngineDeadError as e:
            self.fatal = str(e)
            self._fail_inflight(self.fatal)
            return
        except RequestsFailed as e:   # one data-parallel replica died: its requests end, the others go on
            for eid in e.request_ids:
                if eid in self.inflight:
                    rid = self.inflight.pop(eid)[0]
                    del self.by_user[rid]
                    self._error(LineError(rid, "engine_error", str(e)))
            return
        except Exception as e:  # noqa: BLE001 - a failed step must still end every request it was serving
            self._fail_inflight(f"{type(e).__name__}: {e}")
            return
        for so in outputs:
            self._emit(so)

    def _fail_inflight(self, message: str) -> None:
        """Answer every request in flight with an engine_error, then drop them from the engine."""
        failed = list(self.inflight.items())
        self.inflight.clear()
        self.by_user.clear()
        for eid, (rid, _) in failed:
            self._error(LineError(rid, "engine_error", message))
        for eid, _ in failed:
            self.llm.abort(eid)

    def _abort_all(self) -> None:
        for eid in list(self.inflight):
            self.llm.abort(eid)
        # Aborts are reported by the next step(); with nothing left to schedule it runs no model work.
        while self.inflight and self.llm.has_unfinished_requests():
            for so in self.llm.step():
                self._emit(so)
