"""The HTTP server's engine loop against a scripted fake engine: paths a real model rarely takes (the engine
refusing a request at admission, a step that raises) and the promises the handlers rely on (every request ends,
aborts reach the engine, stop() ends the thread)."""
import asyncio
import threading
import time

import pytest

from minillm.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, StepOutput
from minillm.serve.http.engine_loop import AsyncEngine, EngineFailure, Overloaded


class FakeLLM:
    """Each request emits one token per step for `length` steps; prompts of token 13 are refused; step() raises
    while `broken` is set."""

    def __init__(self, length: int = 3):
        self.length, self.live, self.aborted, self.broken = length, {}, [], threading.Event()
        self.threads = set()

    def add_request(self, ids, params, request_id, priority=0):
        self.threads.add(threading.current_thread().name)
        if 13 in ids:
            raise ValueError("prompt token 13 is unlucky")
        self.live[request_id] = [0, None]

    def abort(self, rid):
        self.aborted.append(rid)
        if rid in self.live:
            self.live[rid][1] = "abort"
            return True
        return False

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.threads.add(threading.current_thread().name)
        if self.broken.is_set():
            raise RuntimeError("device lost")
        outs = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            reason = state[1] or ("length" if state[0] >= self.length else None)
            new = [] if state[1] else [state[0]]
            final = None
            if reason:
                del self.live[rid]
                final = RequestOutput(rid, [1], [CompletionOutput(0, "", [], reason)], RequestMetrics(0.0))
            outs.append(StepOutput(rid, new, "t" * len(new), reason is not None, reason, 0.0, final))
        return outs

    def stats(self):
        return EngineStats(len(self.live), 0, 0.5 if self.live else 0.0, 0)

    engine_in_process = True

    def wake(self):
        pass

    def check_engine(self, timeout_s=0.0):
        pass


async def _drain(q: asyncio.Queue, timeout: float = 5.0) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), timeout)
        items.append(item)
        if isinstance(item, EngineFailure) or item.output is not None:
            return items


def _run(test):
    async def main():
        llm = FakeLLM()
        engine = AsyncEngine(llm, max_waiting=2)
        engine.start()
        try:
            await test(llm, engine)
        finally:
            await engine.stop(timeout=5)
        assert not engine.running
    asyncio.run(main())


def test_requests_stream_to_their_own_queues_and_steps_run_on_the_engine_thread():
    async def test(llm, engine):
        qa, qb = asyncio.Queue(), asyncio.Queue()
        await engine.add("a", [1], None, 0, qa, 0.0)
        await engine.add("b", [2], None, 0, qb, 0.0)
        a, b = await _drain(qa), await _drain(qb)
        assert [so.new_token_ids for so in a] == [[1], [2], [3]] and a[-1].finish_reason == "length"
        assert {so.request_id for so in b} == {"b"}
        assert llm.threads == {"minillm-engine"}
        assert engine.stats.num_running == 0
    _run(test)


def test_engine_refusal_raises_and_leaves_nothing_registered():
    async def test(llm, engine):
        with pytest.raises(ValueError, match="unlucky"):
            await engine.add("x", [13], None, 0, asyncio.Queue(), 0.0)
        assert engine.snapshot()[1] == 0   # nothing counted as on its way any more
        engine.abort("x")                  # a no-op: not registered
        await asyncio.sleep(0.05)
        assert llm.aborted == []
    _run(test)


def test_abort_ends_the_request_with_an_abort_output():
    async def test(llm, engine):
        llm.length = 10 ** 9
        q = asyncio.Queue()
        await engine.add("long", [1], None, 0, q, 0.0)
        await asyncio.wait_for(q.get(), 5)
        engine.abort("long")
        items = await _drain(q)
        assert items[-1].finish_reason == "abort" and llm.aborted == ["long"]
    _run(test)


def test_failed_step_ends_every_request_and_the_loop_keeps_serving():
    async def test(llm, engine):
        llm.length = 10 ** 9
        llm.broken.set()
        q = asyncio.Queue()
        await engine.add("doomed", [1], None, 0, q, 0.0)
        items = await _drain(q)
        assert isinstance(items[-1], EngineFailure) and "device lost" in str(items[-1])
        llm.broken.clear()
        llm.length = 2
        q2 = asyncio.Queue()
        await engine.add("after", [1], None, 0, q2, 0.0)
        assert (await _drain(q2))[-1].finish_reason == "length"
    _run(test)


def test_capacity_bound_and_draining_refuse_new_requests():
    async def test(llm, engine):
        engine.stats = EngineStats(0, 2, 0.0, 0)
        with pytest.raises(Overloaded, match="2 sequences are waiting"):
            engine.check_capacity()
        engine.stats = EngineStats(0, 1, 0.0, 0)
        engine.check_capacity()
        with pytest.raises(Overloaded, match="1 sequences are waiting and this request adds 2"):
            engine.check_capacity(2)   # sequences (prompts x n) count, not requests
        engine.stats = EngineStats(0, 0, 0.0, 0)
        engine.check_capacity(2)
        with pytest.raises(ValueError, match=r"3 sequences \(prompts x n\), more than the 2 that may wait"):
            engine.check_capacity(3)
        engine.begin_drain(60.0)
        with pytest.raises(Overloaded, match="shutting down"):
            engine.check_capacity()
    _run(test)


def test_stop_aborts_what_runs_and_ends_the_thread():
    async def main():
        llm = FakeLLM(length=10 ** 9)
        engine = AsyncEngine(llm)
        engine.start()
        q = asyncio.Queue()
        await engine.add("r", [1], None, 0, q, 0.0)
        await engine.stop(timeout=5)
        assert not engine.running and llm.aborted == ["r"] and not llm.live
    asyncio.run(main())


def test_admission_is_timed_and_adds_queued_for_a_dead_engine_fail_with_its_error():
    from minillm.engine.core_client import EngineDeadError
    from minillm.serve.http.metrics import ServerMetrics

    async def main():
        engine = AsyncEngine(FakeLLM())
        engine.metrics = metrics = ServerMetrics(engine.snapshot)
        engine.start()
        await engine.add("a", [1], None, 0, asyncio.Queue(), time.perf_counter())
        counts = [s.value for s in metrics.admission.collect()[0].samples if s.name.endswith("_count")]
        assert counts == [1.0]   # one admission observed
        await engine.stop(timeout=5)
        fatal = []
        engine.on_fatal = lambda: fatal.append(True)
        waiting = asyncio.ensure_future(engine.add("late", [1], None, 0, asyncio.Queue(), 0.0))
        await asyncio.sleep(0)   # its add is queued; nobody takes it any more
        engine._die("engine core process 0 exited")
        with pytest.raises(EngineDeadError, match="exited"):
            await waiting
        assert fatal == [True] and engine.snapshot()[1] == 0
    asyncio.run(main())
