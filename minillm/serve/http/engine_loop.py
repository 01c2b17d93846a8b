"""The engine loop: one thread owns the LLM and steps for every request; the event loop only enqueues and awaits.

    event loop thread                          engine thread
    add(): register the stream, put ("add")    admit what arrived (add_request); abort what was asked
           await admission  <---------------   one call_soon_threadsafe per batch of admissions
                                               step()
    _dispatch(): route each StepOutput  <----  one call_soon_threadsafe per step: the step's outputs as they are
           to its request's asyncio.Queue

With the engine core in its own process (parallel.engine_process), step() waits on the core's outputs instead
of computing them, and every command put on the queue also wakes it (llm.wake()). If that process dies, every
request gets an error, the thread ends, and on_fatal() tells the server to exit (non-zero).

NOTE: the engine thread does no per-token work beyond handing the step's list over; routing, metrics and JSON all
happen on the event loop's thread. Commands reach the engine thread through a SimpleQueue, so it blocks on that
queue when there is nothing to step (no polling) and never waits on the HTTP side.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from minillm.engine.core_client import EngineDeadError, RequestsFailed
from minillm.engine.outputs import EngineStats

log = logging.getLogger("minillm.serve")

_STOP = ("stop",)
_IDLE_CHECK_S = 0.25       # an idle engine thread checks this often that the engine (process) is alive
_FAILURE_BACKOFF_S = 0.05   # after a failed step, so an engine that fails every step cannot spin a core


class EngineFailure(Exception):
    """Put on a request's queue when a step failed: the request is over, with this message."""


class Overloaded(Exception):
    """The waiting queue is over its bound, or the server is draining: answer 503."""


@dataclass
class _Stream:
    queue: asyncio.Queue    # shared by the engine requests of one HTTP request
    arrival: float          # time.perf_counter() when the HTTP layer received the request


class AsyncEngine:
    def __init__(self, llm, metrics=None, max_waiting: int = 1 << 30):
        self.llm = llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.stats = EngineStats(0, 0, 0.0, 0)   # published by the engine thread after every step
        self.draining = False
        self._adding = 0                          # sequences handed to the engine thread, not yet admitted
        self._streams: dict[str, _Stream] = {}    # engine request id -> its stream, until its final output
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.fatal: str | None = None             # why the engine is gone for good (an engine process died)
        self.on_fatal = None                      # called on the event loop's thread once fatal is set
        self._in_process = llm.engine_in_process

    # ---- event loop side --------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> tuple[EngineStats, int]:
        return self.stats, self._adding

    def check_capacity(self, sequences: int = 1) -> None:
        """Refuse a request of `sequences` sequences (prompts x n: each is one queue entry in the scheduler) that
        would take the waiting queue past its bound: Overloaded (503, retry later), or ValueError (400) for one
        that could never fit, however empty the queue."""
        if sequences > self.max_waiting:
            raise ValueError(f"the request is {sequences:,} sequences (prompts x n), more than the "
                             f"{self.max_waiting:,} that may wait at once (--max-waiting)")
        if self.draining:
            raise Overloaded("the server is shutting down")
        waiting = self.stats.num_waiting + self._adding
        if waiting + sequences > self.max_waiting:
            raise Overloaded(f"{waiting:,} sequences are waiting and this request adds {sequences:,} (the bound, "
                             f"--max-waiting, is {self.max_waiting:,}); retry later")

    async def add(self, rid: str, prompt_ids: list[int], params, priority: int, q: asyncio.Queue,
                  arrival: float) -> None:
        """Hand one request to the engine thread and wait until it is admitted; raises what add_request raised
        (ValueError: the engine refused it). Its StepOutputs then arrive on q."""
        fut = self._loop.create_future()
        self._streams[rid] = _Stream(q, arrival)
        self._adding += _sequences(params)
        self._put(("add", rid, prompt_ids, params, priority, fut))
        try:
            await fut
        except asyncio.CancelledError:   # the client left while the request was on its way: drop it there
            self.abort(rid)
            raise
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt_ids))

    def abort(self, rid: str) -> None:
        """Abort a request that has not finished (no-op otherwise). Its blocks are freed by the engine thread at
        once; its final output (finish_reason "abort") is still dispatched, so metrics count it."""
        if rid in self._streams:
            self._put(("abort", rid))

    def _put(self, cmd) -> None:
        self._inbox.put(cmd)
        self.llm.wake()   # a step() waiting on an engine process returns, so the command is taken now

    def begin_drain(self, grace_s: float) -> None:
        """Refuse new requests from now on; abort whatever still runs after grace_s, so every stream still ends
        with a final chunk (finish_reason "abort") and [DONE] instead of a cut connection."""
        self.draining = True
        self._loop.call_later(grace_s, self.abort_all)

    def abort_all(self) -> None:
        for rid in list(self._streams):
            self._put(("abort", rid))

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort everything still registered, let the engine report it, and end the thread."""
        self.abort_all()
        self._put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    def _admitted(self, results: list) -> None:
        for rid, n, fut, error, when in results:
            self._adding -= n
            if error is not None:
                self._streams.pop(rid, None)
            elif self.metrics is not None and rid in self._streams:
                self.metrics.admission.observe(max(0.0, when - self._streams[rid].arrival))
            if fut.done():        # its handler was cancelled meanwhile (and asked for an abort)
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    def _dispatch(self, outputs: list, stats: EngineStats) -> None:
        self.stats = stats
        streams, tokens = self._streams, 0
        for so in outputs:
            tokens += len(so.new_token_ids)
            stream = streams.get(so.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(so)
            if so.output is not None:
                del streams[so.request_id]
                if self.metrics is not None:
                    self.metrics.on_finished(so.output, stream.arrival)
        if tokens and self.metrics is not None:
            self.metrics.generation_tokens.inc(tokens)

    def _set_stats(self, stats: EngineStats) -> None:
        self.stats = stats

    def _fail_all(self, message: str) -> None:
        """A step raised: end every registered request with an error and have the engine drop them."""
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(EngineFailure(message))
            self._put(("abort", rid))
            del self._streams[rid]

    def _fail_some(self, rids: list[str], message: str) -> None:
        """End these requests with an error (the engine has dropped them already)."""
        for rid in rids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.queue.put_nowait(EngineFailure(message))

    def _die(self, message: str) -> None:
        """The engine is gone: fail what is registered or on its way, refuse new requests, tell the server."""
        self.fatal = message
        self.draining = True
        self._admitted(self._unsent_adds(message))   # the engine thread is gone: nobody else answers them
        self._fail_all(message)
        if self.on_fatal is not None:
            self.on_fatal()

    def call_soon(self, callback, *args) -> None:
        """Run callback on the event loop's thread; safe from any thread and from a signal handler."""
        self._post(callback, *args)

    def _post(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:   # the event loop is closed: the server is gone, nobody is listening
            pass

    # ---- engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._steps()
        except EngineDeadError as e:
            log.error("%s; failing every request", e)
            self._post(self._die, str(e))

    def _steps(self) -> None:
        llm = self.llm
        while True:
            idle = not llm.has_unfinished_requests()
            if idle and self._stopping:
                return
            self._take_commands(block=idle)
            if not llm.has_unfinished_requests():
                continue
            try:
                outputs = llm.step()
            except EngineDeadError:
                raise
            except RequestsFailed as e:   # one data-parallel replica died: its requests end, the others go on
                log.error("%s", e)
                self._post(self._fail_some, e.request_ids, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - every request in flight must still get an answer
                log.exception("engine step failed")
                self._post(self._fail_all, f"engine step failed: {type(e).__name__}: {e}")
                time.sleep(_FAILURE_BACKOFF_S)
                continue
            self._post(self._dispatch, outputs, llm.stats())

    def _unsent_adds(self, message: str) -> list:
        """The adds still queued for a dead engine, as failed admissions (their handlers are waiting)."""
        failed = []
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                failed.append((cmd[1], _sequences(cmd[3]), cmd[5], EngineDeadError(message), 0.0))
        return failed

    def _take_commands(self, block: bool) -> None:
        """Admit and abort whatever has arrived; when `block`, first wait for at least one command."""
        admitted = []
        while True:
            try:
                # Idle with engine processes: wait on them (their stats, a wake-up from _put, their death)
                # rather than on the queue, so gauges follow an abort at once.
                remote = block and not self._in_process
                cmd = self._inbox.get(timeout=_IDLE_CHECK_S) if block and not remote else self._inbox.get_nowait()
            except queue.Empty:
                if block:   # an engine process that died meanwhile raises EngineDeadError here
                    self.llm.check_engine(_IDLE_CHECK_S if remote else 0.0)
                    self._post(self._set_stats, self.llm.stats())
                    continue
                break
            block = False
            if cmd[0] == "add":
                _, rid, ids, params, priority, fut = cmd
                try:
                    self.llm.add_request(ids, params, request_id=rid, priority=priority)
                    admitted.append((rid, _sequences(params), fut, None, time.perf_counter()))
                except Exception as e:  # noqa: BLE001 - ValueError is a refusal (400); anything else a 500
                    admitted.append((rid, _sequences(params), fut, e, 0.0))
            elif cmd[0] == "abort":
                try:
                    self.llm.abort(cmd[1])
                except Exception:  # noqa: BLE001 - the loop must outlive one bad abort
                    log.exception("abort of %s failed", cmd[1])
            else:
                self._stopping = True
        if admitted:
            self._post(self._admitted, admitted)


def _sequences(params) -> int:
    """Queue entries a request takes in the scheduler: one per completion (None: the engine's defaults, n=1)."""
    return 1 if params is None else params.n
