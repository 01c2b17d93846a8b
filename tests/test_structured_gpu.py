"""Structured outputs on a GPU: the bitmask op on the device equals the CPU op, and constrained generation with
async scheduling (masks built while the next step's forward runs), CUDA graphs and the CUDA sampler gives the
tokens of synchronous steps, every output inside its grammar."""
import dataclasses
import re

import pytest
import torch

from minillm.llm import LLM
from minillm.sampling.grammar_mask import GrammarMask, apply_grammar_mask
from minillm.sampling_params import SamplingParams
from minillm.structured.spec import from_structured_outputs
from test_structured_gpu_wait import _count_rings

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("rows,v,words", [(None, 151936, None), ([1, 5, 6], 151936, None), ([7, 0], 1000, 40),
                                          (None, 33, None)])
def test_mask_op_on_the_device_equals_the_cpu_op(rows, v, words, kernel):
    """The torch path on the device and the kernel (cuda/grammar_mask.cu) both equal the CPU reference, also with
    a vocabulary that is not a multiple of 32 and a bitmask wider than it (its extra bits never reach logits)."""
    if kernel:
        from minillm.ops.build import load_extension
        load_extension()
    g = torch.Generator().manual_seed(0)
    n = 8
    logits = torch.randn(n, v, generator=g)
    m = n if rows is None else len(rows)
    words = words or (v + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (m, words), dtype=torch.int32, generator=g)
    idx = None if rows is None else torch.tensor(rows)
    cpu = logits.clone()
    apply_grammar_mask(cpu, GrammarMask(bitmask, idx))
    assert torch.isinf(cpu).any() and torch.isfinite(cpu).any()
    dev = logits.cuda()
    apply_grammar_mask(dev, GrammarMask(bitmask.cuda(), None if idx is None else idx.cuda()), cuda=kernel)
    assert torch.equal(dev.cpu(), cpu)


def test_mask_kernel_refuses_a_bitmask_narrower_than_the_vocabulary():
    from minillm.ops.build import load_extension
    load_extension()
    logits = torch.zeros(2, 100, device="cuda")
    with pytest.raises(ValueError, match="words a row"):
        torch.ops.minillm.grammar_mask_(logits, torch.zeros(2, 3, dtype=torch.int32, device="cuda"), None)


def _release_gpu() -> None:
    """Give a closed, unreferenced engine's GPU memory back before the next one is built (KV sizing counts it)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def test_constrained_async_equals_sync_on_the_gpu():
    llm = LLM(device="cuda", max_num_seqs=16, num_kv_blocks=512)
    pattern = "[a-z]{5,20}-[0-9]{2,4}"
    spec = from_structured_outputs({"regex": pattern})
    prompts = [f"item {i}:" for i in range(12)]
    params = [SamplingParams(temperature=t, max_tokens=48, seed=i, structured=spec if i % 3 else None)
              for i, t in zip(range(12), [1.0, 0.0, 0.7] * 4)]
    first = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    cfg = core.cfg
    core.cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, async_scheduling=False))
    try:
        second = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.cfg = cfg
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    for i, o in enumerate(first):
        if i % 3 and o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    assert sum(bool(i % 3) and o.outputs[0].finish_reason == "stop" for i, o in enumerate(first)) >= 6
    llm.close()
    del llm, core, first, second
    _release_gpu()


def _flag_kernel():
    from minillm.ops.build import load_extension
    load_extension()
    from minillm.sampling.grammar_mask import wait_for_host_flag
    return wait_for_host_flag


def _wait_then_copy(flags, addr: int, host: torch.Tensor, answer: str):
    """Queue the wait on flags[1] (seq 7, host address `addr`) and the copy of `host` behind it, then have a thread
    write new data into `host` and, after it, the flag (7 filled, -7 failed, nothing: silent). Returns (the data
    written, the device copy, the wait's status, the seconds the stream took)."""
    import threading
    import time

    wait_for_host_flag = _flag_kernel()
    want = torch.randint(-2**31, 2**31 - 1, host.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    status = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    seq = 7

    def publish():
        time.sleep(0.05)   # long after the copy below was queued
        host.copy_(want)
        flags[1] = seq if answer == "filled" else -seq

    t0 = time.perf_counter()
    wait_for_host_flag(status, addr, seq, 0.5 if answer == "silent" else 30.0)
    dev = host.to("cuda", non_blocking=True)
    thread = threading.Thread(target=publish)
    if answer != "silent":
        thread.start()
    torch.cuda.synchronize()
    waited = time.perf_counter() - t0
    if answer != "silent":
        thread.join()
    return want, dev.cpu(), status.item(), waited


@pytest.mark.parametrize("answer", ["filled", "failed", "silent"])
def test_the_stream_waits_for_a_host_flag_then_reads_what_came_before_it(answer):
    """cuda/grammar_mask.cu wait_host_flag: work queued behind the wait sees the bitmask the host wrote before the
    flag (reference: the host's own data); -seq lets it go on too (status 2), and no flag at all only delays it by
    the timeout (status 1)."""
    flags = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    host = torch.zeros(64, 4748, dtype=torch.int32, pin_memory=True)
    want, got, status, waited = _wait_then_copy(flags, flags.data_ptr() + 8, host, answer)
    if answer == "silent":
        assert status == 1 and waited >= 0.5
        return
    assert torch.equal(got, want)
    assert status == (0 if answer == "filled" else 2) and waited >= 0.05


def test_registered_shared_memory_is_pinned_and_waited_on():
    """The worker's shared memory, registered (GrammarRows with the matchers in a worker): torch copies from it
    in stream order behind the wait, which polls a flag in it."""
    from multiprocessing import shared_memory

    import numpy as np

    from minillm.sampling.grammar_mask import register_host_memory, unregister_host_memory
    shm = shared_memory.SharedMemory(create=True, size=64 + 4 * 64 * 4748)
    try:
        flags = np.ndarray((2,), dtype=np.int64, buffer=shm.buf)
        words = np.ndarray((64, 4748), dtype=np.int32, buffer=shm.buf, offset=64)
        flags[:] = 0
        words[:] = 0
        register_host_memory(flags.ctypes.data, shm.size)
        try:
            view = torch.from_numpy(words)
            assert view.is_pinned()
            want, got, status, waited = _wait_then_copy(flags, flags.ctypes.data + 8, view, "filled")
            assert torch.equal(got, want) and status == 0 and waited >= 0.05
        finally:
            torch.cuda.synchronize()
            unregister_host_memory(flags.ctypes.data)
        del flags, words, view
    finally:
        shm.close()
        shm.unlink()


def test_published_tokens_reach_registered_memory_behind_the_stream_then_their_flag():
    """cuda/grammar_mask.cu publish_host_tokens (GrammarRows.publish): queued behind ~50 ms of GPU work, the flag
    is not set before that work ends; once the host sees it, the tokens (reference: the device tensor) are there."""
    import time
    from multiprocessing import shared_memory

    import numpy as np

    _flag_kernel()
    from minillm.sampling.grammar_mask import publish_host_tokens, register_host_memory, unregister_host_memory
    shm = shared_memory.SharedMemory(create=True, size=64 + 8 * 300)
    try:
        flag = np.ndarray((1,), dtype=np.int64, buffer=shm.buf)
        dst = np.ndarray((300,), dtype=np.int64, buffer=shm.buf, offset=64)
        flag[:], dst[:] = 0, -1
        register_host_memory(flag.ctypes.data, shm.size)
        try:
            tokens = torch.randint(0, 151936, (300,), dtype=torch.int64, device="cuda")
            torch.cuda._sleep(50_000_000)   # ~50 ms of spinning on the stream
            publish_host_tokens(tokens, dst.ctypes.data, flag.ctypes.data, 9)
            assert flag[0] == 0
            end = time.monotonic() + 10
            while flag[0] != 9 and time.monotonic() < end:
                pass
            assert flag[0] == 9 and np.array_equal(dst, tokens.cpu().numpy())
        finally:
            torch.cuda.synchronize()
            unregister_host_memory(flag.ctypes.data)
        del flag, dst
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("worker,workers", [(True, 1), (True, 2), (False, 1)])
def test_the_stream_waiting_for_masks_gives_the_host_launched_tokens(monkeypatch, worker, workers):
    """structured.mask_wait auto (the stream waits on the fill's flags, the sampler queued behind the forward) gives
    the tokens of mask_wait host (the sampler launched by the host once the fill is in): seeds, greedy, n > 1,
    min_tokens, unconstrained rows beside constrained ones; one worker, two (the stream waits on both flags), or
    the matchers on a thread."""
    spec = from_structured_outputs({"regex": "[a-z]{5,20}-[0-9]{2,4}"})
    prompts = [f"item {i}:" for i in range(12)]
    params = [SamplingParams(temperature=t, max_tokens=40, seed=i, n=2 if i == 4 else 1, min_tokens=8 if i == 5 else 0,
                             structured=spec if i % 3 else None)
              for i, t in zip(range(12), [1.0, 0.0, 0.7] * 4)]
    outs = {}
    for wait in ("auto", "host"):
        llm = LLM(device="cuda", max_num_seqs=16, num_kv_blocks=512, structured_mask_worker=worker,
                  structured_mask_workers=workers, structured_mask_wait=wait)
        assert llm.engine.runner.grammar.gpu_wait is (wait == "auto")
        rings = _count_rings(monkeypatch)
        outs[wait] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(rings) is (worker and wait == "auto")   # steady steps followed on from published tokens
        assert not llm.engine.runner.grammar._unsettled
        llm.close()
        del llm
        _release_gpu()
    assert outs["auto"] == outs["host"]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dead_worker_fails_the_fenced_step_without_hanging_the_stream(workers):
    import os
    import signal

    spec = from_structured_outputs({"regex": "[a-z]{5,20}-[0-9]{2,4}"})
    with LLM(device="cuda", max_num_seqs=4, num_kv_blocks=512, structured_mask_worker=True,
             structured_mask_workers=workers, structured_mask_wait="auto") as llm:
        assert llm.engine.runner.grammar.gpu_wait
        llm.generate(["warm:"], SamplingParams(max_tokens=4, structured=spec), use_tqdm=False)
        worker = llm.engine.runner.grammar._worker
        for p in ("a:", "b:"):
            llm.add_request(p, SamplingParams(max_tokens=30, structured=spec))
        llm.step()
        llm.step()
        dead = worker.procs[-1]
        os.kill(dead.pid, signal.SIGKILL)   # with a fill handed over or about to be
        dead.join(5)
        with pytest.raises(RuntimeError, match="grammar mask worker"):
            for _ in range(40):
                llm.step()
        torch.cuda.synchronize()   # the stream was let go: this returns
