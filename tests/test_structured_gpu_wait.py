"""gpu_wait (structured.mask_wait auto on CUDA): the stream waits on a host flag that the filler sets, the sampler
queued behind the forward. On the CPU the stream's wait is emulated on the host (it spins on the same flag, as
the kernel does, and gives up after a bound): the tokens equal those of the host-launched sampler, every fill
is waited for under its own sequence number, the filler sets the flag itself (worker or thread), and a worker
that stops answering fails the step with its name and lets the stream go on."""
import os
import signal
import time

import pytest

import minillm.structured.rows as rows_mod
from minillm.config import ConfigError, EngineConfig, StructuredConfig
from minillm.llm import LLM
from test_structured_worker import REGEX, _requests

pytestmark = pytest.mark.slow   # engines with a worker process


class FakeStream:
    """wait_for_host_flag, run eagerly: spin on the flag like the kernel, at most `bound_s`. A request's first
    fill waits for its worker to start and compile the grammar: seconds on a loaded two-core machine, where a
    3 s bound made the test fail now and then."""

    def __init__(self, bound_s=30.0):
        self.waits, self.ends, self.bound_s = [], [], bound_s

    def wait(self, status, addr, expect, timeout_s):
        import ctypes
        assert timeout_s > 10
        self.waits.append(expect)
        flag = ctypes.c_int64.from_address(addr)
        end = time.monotonic() + self.bound_s
        while flag.value not in (expect, -expect) and time.monotonic() < end:
            time.sleep(1e-4)
        self.ends.append(0 if flag.value == expect else 2 if flag.value == -expect else 1)
        status.fill_(self.ends[-1])


@pytest.fixture
def stream(monkeypatch):
    fake = FakeStream()
    registered = []
    monkeypatch.setattr(rows_mod, "wait_for_host_flag", fake.wait)
    monkeypatch.setattr(rows_mod, "register_host_memory", lambda addr, n: registered.append((addr, n)))
    monkeypatch.setattr(rows_mod, "unregister_host_memory", lambda addr: registered.remove(
        next(r for r in registered if r[0] == addr)))
    fake.registered = registered
    return fake


def _gpu_wait_llm(worker: bool, **kw) -> LLM:
    llm = LLM(device="cpu", max_num_seqs=8, structured_mask_worker=worker, **kw)
    grammar = llm.engine.runner.grammar
    assert grammar._worker is None and not grammar.gpu_wait   # the CPU default; the stream is emulated here
    grammar.gpu_wait = True
    return llm


@pytest.mark.parametrize("worker,workers", [(True, 1), (True, 2), (False, 1)])
def test_the_stream_waiting_gives_the_host_launched_tokens(stream, monkeypatch, worker, workers):
    from minillm.sampling_params import SamplingParams
    prompts, params = _requests()
    # a constrained row asking for logprobs: its step settles before the sampler reads them back
    prompts.append("logprobs:")
    params.append(SamplingParams(temperature=1.0, max_tokens=12, seed=5, logprobs=2, structured=REGEX))
    with LLM(device="cpu", max_num_seqs=8, structured_mask_worker=worker) as ref:
        want = [[c.token_ids for c in o.outputs] for o in ref.generate(prompts, params, use_tqdm=False)]
    rings = _count_rings(monkeypatch)
    with _gpu_wait_llm(worker, structured_mask_workers=workers) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [[c.token_ids for c in o.outputs] for o in outs]
        assert outs[-1].outputs[0].logprobs and len(outs[-1].outputs[0].logprobs) == len(got[-1][0])
        grammar = llm.engine.runner.grammar
        assert stream.registered == ([(grammar._flags.ctypes.data, grammar._worker.shm.size)] if worker else [])
        assert not grammar._unsettled   # every fenced step was settled
    assert got == want
    # every fill waited for under its own number, on each worker's flag in turn
    assert stream.waits == [q for q in range(1, len(stream.waits) // workers + 1) for _ in range(workers)]
    assert len(stream.waits) > 10 * workers
    assert set(stream.ends) == {0}   # the filler set each flag itself, before the host took its answer
    # with a worker, most decode steps were handed over by a ring alone (the steady path), the rest as messages
    assert (len(rings) > len(stream.waits) // workers // 2) if worker else not rings
    assert stream.registered == []   # unregistered at close
    if worker:   # preemption (a pool too small for every row: matchers rolled back) gives the same tokens too
        with _gpu_wait_llm(worker, num_kv_blocks=12, max_model_len=128) as llm:
            small = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.stats().num_preemptions > 0
        assert small == want


def _count_rings(monkeypatch) -> list:
    from minillm.structured.mask_worker import MaskWorker
    rings, ring = [], MaskWorker.ring
    monkeypatch.setattr(MaskWorker, "ring", lambda self, turn, seq: (rings.append(seq), ring(self, turn, seq))[1])
    return rings


def test_a_sleeping_worker_wakes_for_a_ring_and_a_failed_ring_names_its_error():
    """MaskWorker alone: a full fill, its step's tokens published as GrammarRows.publish stores them, then a ring
    after the worker has gone to sleep (past its spin): the bitmask is the in-process matcher's one token further.
    A ring for a request the worker no longer holds fails with its reason, and the worker serves on."""
    import time

    import numpy as np
    import xgrammar as xgr

    from minillm.model.loader import DEMO_MODEL_DIR
    from minillm.structured import mask_worker
    from minillm.structured.compiler import grammar_service
    from minillm.structured.matchers import publish_flag

    cfg, vocab = StructuredConfig(), 4096
    worker = mask_worker.MaskWorker(DEMO_MODEL_DIR, vocab, cfg, 4)
    try:
        shared = worker.shared
        worker.open("r", REGEX, (), (), 0)
        worker.fill(1, [(0, "r", 0, (), 0, False, 2)], worker.buffers[1, :1], seq=1)
        worker.wait(1, worker.buffers[1, :1])
        matcher = xgr.GrammarMatcher(grammar_service(DEMO_MODEL_DIR, vocab, cfg).compiled(REGEX))
        want = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(want)
        token = int(np.flatnonzero(np.unpackbits(want.numpy().view(np.uint8), bitorder="little"))[0])
        shared.tokens[1, :3] = (-1, -1, token)   # fill 1's step sampled `token` in row 2
        publish_flag(shared.token_flags, 1, 1)
        end = time.monotonic() + 10
        while not shared.sleeping[0] and time.monotonic() < end:
            time.sleep(0.01)
        assert shared.sleeping[0] == 1   # past _SPIN_S with nothing to do
        worker.ring(0, 2)
        worker.settle_ring(0, 2)
        assert matcher.accept_token(token)
        matcher.fill_next_token_bitmask(want)
        assert np.array_equal(worker.buffers[0, :1], want.numpy()) and worker.flags[0, 0] == 2
        worker.drop(["r"])
        shared.tokens[0, :3] = (-1, -1, token)
        publish_flag(shared.token_flags, 0, 2)
        worker.ring(1, 3)
        with pytest.raises(RuntimeError, match="dropped"):
            worker.settle_ring(1, 3)
        assert worker.flags[0, 1] == -3
        worker.fill(0, [], worker.buffers[0, :0], seq=4)   # it serves on
        worker.wait(0, worker.buffers[0, :0])
        assert worker.flags[0, 0] == 4
    finally:
        worker.close()


def test_a_worker_that_stops_answering_fails_the_step_and_releases_the_stream(stream):
    with _gpu_wait_llm(True) as llm:
        llm.generate(["warm:"], [_params()], use_tqdm=False)
        grammar = llm.engine.runner.grammar
        worker = grammar._worker
        worker.timeout_s = stream.bound_s = 1.0
        os.kill(worker.procs[0].pid, signal.SIGSTOP)   # alive, but it never fills (nor sets the flag)
        try:
            with pytest.raises(RuntimeError, match="grammar mask worker did not answer"):
                llm.generate(["again:"], [_params()], use_tqdm=False)
            seq = stream.waits[-1]
            assert stream.ends[-1] == 1                      # the emulated stream gave up on its own bound
            assert -seq in grammar._flags[0].tolist()          # the host released it when the step failed
            assert not grammar._unsettled
        finally:
            os.kill(worker.procs[0].pid, signal.SIGKILL)


def _params():
    from minillm.sampling_params import SamplingParams
    return SamplingParams(max_tokens=6, structured=REGEX)


def test_mask_wait_is_a_checked_config_key():
    with pytest.raises(ConfigError, match="structured.mask_wait"):
        EngineConfig.from_kwargs(None, structured_mask_wait="gpu").validate()
    auto, host = StructuredConfig(), StructuredConfig(mask_wait="host")
    assert auto.gpu_waits_for_masks("cuda", 1, True) is True
    assert host.gpu_waits_for_masks("cuda", 1, True) is False
    assert auto.gpu_waits_for_masks("cpu", 1, True) is False
    assert auto.gpu_waits_for_masks("cuda", 2, True) is False      # TP: fills waited for at once
    assert auto.gpu_waits_for_masks("cuda", 1, False) is False     # no kernels: the host launches the sampler
    assert StructuredConfig(overlap_masks=False).gpu_waits_for_masks("cuda", 1, True) is False


def test_a_fill_on_the_thread_that_does_not_finish_in_time_fails_the_step(monkeypatch):
    """The matchers' thread is bounded like the worker, so the host gives up before a waiting stream would."""
    import threading

    import numpy as np

    from minillm.structured.mask_thread import MaskThread
    release = threading.Event()
    flags = np.zeros(2, dtype=np.int64)
    masks = MaskThread(None, 64, StructuredConfig(), flags)
    monkeypatch.setattr(masks.matchers, "fill", lambda work, out: release.wait(5))
    masks.timeout_s = 0.1
    try:
        masks.fill(1, [], np.zeros((1, 2), dtype=np.int32), seq=4)
        with pytest.raises(RuntimeError, match="did not finish a fill within 0.1 s"):
            masks.wait(1, None)
        assert flags[1] == 0   # not done: a stream waiting on it is let go by GrammarRows.settle, not here
        release.set()
    finally:
        masks.close()
    assert flags[1] == 4


def test_the_worker_stores_the_flag_of_a_fill_and_its_negative_when_it_fails():
    import numpy as np

    from minillm.structured.mask_worker import MaskWorker
    from minillm.structured.matchers import RowWork
    worker = MaskWorker(None, 64, StructuredConfig(), 2)
    try:
        out = worker.buffers[0, :0]
        worker.fill(0, [], out, seq=5)   # nothing to fill: done at once
        worker.wait(0, out)
        assert worker.flags[0, 0] == 5   # worker 0's flag for buffer 0
        worker.fill(1, [RowWork(0, "unknown", 0, (), 0, False)], np.zeros((1, 2), dtype=np.int32), seq=6)
        with pytest.raises(RuntimeError, match="grammar mask worker failed: KeyError"):
            worker.wait(1, np.zeros((1, 2), dtype=np.int32))
        assert worker.flags.tolist() == [[5, -6]]
    finally:
        worker.close()
