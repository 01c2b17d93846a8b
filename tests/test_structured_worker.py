"""structured.mask_worker: the grammar matchers in a process of their own, the sampler of a constrained step
launched once its mask is filled. Token for token the output of the matchers on a thread (the default; async
and synchronous steps, seeds, n > 1, min_tokens, preemption, an abort), no process, thread or shared memory
left after close, and a worker that dies fails the step with a message that names it."""
import os
import signal
import threading

import pytest

from minillm.config import ConfigError, EngineConfig
from minillm.llm import LLM
from minillm.sampling_params import SamplingParams
from minillm.structured.spec import from_structured_outputs
from test_engine_process import _children

pytestmark = pytest.mark.slow   # each engine here starts a worker process

REGEX = from_structured_outputs({"regex": "[a-z]{3,12}(-[0-9]{1,3}){1,4}"})
SCHEMA = from_structured_outputs({"json": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                          "maxItems": 3}},
    "required": ["name", "tags"]}})


def _requests():
    prompts = [f"item {i}:" for i in range(10)]
    params = [SamplingParams(temperature=t, max_tokens=40, seed=i, n=2 if i == 3 else 1, min_tokens=6 if i == 4 else 0,
                             structured=[REGEX, SCHEMA, None][i % 3])
              for i, t in zip(range(10), [1.0, 0.0, 0.8, 1.0, 0.7] * 2)]
    return prompts, params


def _mask_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("minillm-grammar-masks")}


def _run(worker: bool, **kw):
    """(token ids of every completion, the worker process's shared-memory name or None: matchers on a thread)."""
    with LLM(device="cpu", max_num_seqs=8, structured_mask_worker=worker, **kw) as llm:
        prompts, params = _requests()
        out = llm.generate(prompts, params, use_tqdm=False)
        where = llm.engine.runner.grammar._worker
        _run.preemptions = llm.stats().num_preemptions
        return [[c.token_ids for c in o.outputs] for o in out], where.shm.name if worker else None


def test_worker_gives_the_in_process_tokens_and_leaves_nothing_behind():
    before = set(_children(os.getpid()))
    threads = _mask_threads()
    want, none = _run(False)
    got, shm = _run(True)
    assert none is None and shm is not None
    assert got == want
    assert set(_children(os.getpid())) == before   # closed: the worker is gone, and its shared memory
    assert _mask_threads() <= threads   # no matchers thread of ours is left (an older one may end meanwhile)
    assert not os.path.exists(f"/dev/shm/{shm.lstrip('/')}")
    # preemption (a pool too small for every row) and synchronous steps give the same tokens too
    small, _ = _run(True, num_kv_blocks=12, max_model_len=128, async_scheduling=False)
    assert small == want and _run.preemptions > 0


def test_two_workers_split_the_requests_and_give_the_in_process_tokens():
    """structured.mask_workers 2: each request's matcher in one of two processes, a step's rows filled by both."""
    want, _ = _run(False)
    before = set(_children(os.getpid()))
    with LLM(device="cpu", max_num_seqs=8, structured_mask_worker=True, structured_mask_workers=2) as llm:
        prompts, params = _requests()
        owners, step = set(), llm.engine.step
        def spy():   # which workers hold live requests, at every step
            owners.update(llm.engine.runner.grammar.matchers.owner.values())
            return step()
        llm.engine.step = spy
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert len(llm.engine.runner.grammar.matchers.procs) == 2
    assert got == want and owners == {0, 1}
    assert set(_children(os.getpid())) == before


def test_an_abort_mid_run_leaves_the_other_constrained_rows_exact():
    params = [SamplingParams(temperature=1.0, max_tokens=30, seed=s, structured=REGEX) for s in (1, 2, 3)]
    with LLM(device="cpu", max_num_seqs=4) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(["a:", "c:"], [params[0], params[2]], use_tqdm=False)]
    with LLM(device="cpu", max_num_seqs=4, structured_mask_worker=True) as llm:
        ids = [llm.add_request(p, sp) for p, sp in zip(["a:", "b:", "c:"], params)]
        done, steps = {}, 0
        while llm.has_unfinished_requests():
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = o
            steps += 1
            if steps == 4:
                assert llm.abort(ids[1])
        assert done[ids[1]].finish_reason == "abort"
        assert [done[i].output.outputs[0].token_ids for i in (ids[0], ids[2])] == want


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dead_worker_fails_the_step_with_its_name(workers):
    with LLM(device="cpu", max_num_seqs=4, structured_mask_worker=True, structured_mask_workers=workers) as llm:
        llm.generate(["warm:"], SamplingParams(max_tokens=2, structured=REGEX), use_tqdm=False)
        worker = llm.engine.runner.grammar._worker
        dead = worker.procs[-1]   # with two, the one that holds no request: its empty fills fail the step
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(5)
        with pytest.raises(RuntimeError, match="grammar mask worker"):
            llm.generate(["again:"], SamplingParams(max_tokens=8, structured=REGEX), use_tqdm=False)


def test_the_worker_is_refused_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="structured.mask_worker"):
        EngineConfig.from_kwargs(None, structured_mask_worker=True, tensor_parallel_size=2).validate()


def test_auto_puts_the_matchers_in_a_worker_on_cuda_with_one_rank_only():
    from minillm.config import StructuredConfig
    auto = StructuredConfig()
    assert auto.mask_worker == "auto"
    assert auto.matchers_in_worker("cuda", 1) is True
    assert auto.matchers_in_worker("cpu", 1) is False
    assert auto.matchers_in_worker("cuda", 2) is False
    assert StructuredConfig(mask_worker=False).matchers_in_worker("cuda", 1) is False
    assert StructuredConfig(mask_worker=True).matchers_in_worker("cpu", 1) is True
    EngineConfig.from_kwargs(None, tensor_parallel_size=2).validate()   # auto with TP: served, on the thread
    with pytest.raises(ConfigError, match="structured.mask_worker"):
        EngineConfig.from_kwargs(None, structured_mask_worker="sometimes").validate()


def test_all_then_mixed_batches_on_one_engine_equal_the_in_process_matchers():
    """The mask buffers first filled from a launch (inside inference mode), then from a resolve: both work."""
    def run(worker):
        with LLM(device="cpu", max_num_seqs=4, structured_mask_worker=worker) as llm:
            every = [SamplingParams(temperature=0.0, max_tokens=12, structured=REGEX) for _ in range(3)]
            mixed = [SamplingParams(temperature=0.0, max_tokens=12, structured=REGEX if i % 2 else None)
                     for i in range(4)]
            first = llm.generate(["x:", "y:", "z:"], every, use_tqdm=False)
            second = llm.generate(["p:", "q:", "r:", "s:"], mixed, use_tqdm=False)
            return [o.outputs[0].token_ids for o in first + second]
    assert run(True) == run(False)


@pytest.mark.parametrize("end", ["close", "gc"])
def test_the_unmap_hooks_run_while_the_shared_memory_is_still_mapped(end):
    """A CUDA registration of the worker's memory is undone by such a hook (GrammarRows): it must run before the
    mapping goes, whether close() or the garbage collector ends the worker, and the segment still goes after."""
    import gc

    import numpy as np

    from minillm.structured.mask_worker import MaskWorker

    worker = MaskWorker("unused", 64, EngineConfig().structured, 2)
    name, seen = worker.shm.name, []
    buf = worker.shm.buf

    def hook():
        seen.append(int(np.frombuffer(buf, dtype=np.int64, count=1)[0]))   # readable: still mapped
        buf.release()

    worker.before_unmap.append(hook)
    worker.before_unmap.append(lambda: 1 / 0)   # a failing hook does not keep the segment alive
    worker.flags[0] = 7
    if end == "close":
        worker.close()
    else:
        del worker
        gc.collect()
    assert seen == [7]
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")
