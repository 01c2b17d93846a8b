"""LLMEngine: prompts in, streamed outputs out. It joins the engine core (schedule -> execute -> update, token ids
only: minillm/engine/core.py) and the output processor (text, stop strings, n > 1 groups, metrics:
minillm/engine/output_processor.py), and prepares prompts (minillm/engine/prompts.py). Each step it hands the
core's outputs to the processor, then applies what the processor decided back in the core: held n > 1 siblings to
admit, completions a stop string ended.
"""
from __future__ import annotations

import dataclasses
import itertools

from minillm.config import EngineConfig
from minillm.engine.core import EngineCore
from minillm.engine.core_client import CoreClient, RequestsFailed
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.outputs import EngineStats, StepOutput
from minillm.engine.prompts import PromptPreparer
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams


def make_core(cfg: EngineConfig, serving: bool = False):
    """The engine core: in this process, or engine-core processes behind a CoreClient
    (parallel.engine_process, decided in ParallelConfig.engine_in_process). Under torchrun a tensor-parallel core
    is always in this process: torchrun made this process its rank (ranks other than 0 never return)."""
    if cfg.parallel.tensor_parallel_size > 1:
        from minillm.parallel.dist import torchrun_env
        from minillm.parallel.tp_engine import build_tp_runner
        if torchrun_env() is not None or cfg.parallel.engine_in_process(serving):
            return EngineCore(cfg, runner=build_tp_runner(cfg))
    elif cfg.parallel.engine_in_process(serving):
        return EngineCore(cfg)
    return CoreClient(cfg)


def close_core(core) -> None:
    """Stop what a core started: engine-core processes (a CoreClient), tensor-parallel ranks (its runner)."""
    for owner in (core, getattr(core, "runner", None)):
        close = getattr(owner, "close", None)
        if close is not None:
            close()
            return


class LLMEngine:
    def __init__(self, cfg: EngineConfig, serving: bool = False):
        self.cfg = cfg
        self.core = make_core(cfg, serving)
        self.runner = self.core.runner
        self.scheduler = getattr(self.core, "scheduler", None)   # None: the core runs in another process
        self.max_model_len = self.core.max_model_len
        self.prompts = PromptPreparer(self.runner.model_dir, self.runner.arch, self.max_model_len,
                                      cfg.scheduler.max_num_seqs)
        self.tokenizer = self.prompts.tokenizer
        self.outputs = OutputProcessor(self.prompts)
        self._pending: list[StepOutput] = []
        self._ids = itertools.count()

    @property
    def profile(self):
        """A StepProfile (minillm.engine.profile) when a caller wants the per-step breakdown, else None."""
        return self.core.profile

    @profile.setter
    def profile(self, value) -> None:
        self.core.profile = value

    # ---- admission -------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, stream: bool = True, enable_thinking: bool | None = None) -> str:
        """Validate, then admit. Raises ValueError naming the problem; a rejected request leaves no state.
        A PreparedPrompt (what prompts.prepare() returned, e.g. on a front end's own thread) has its ids checked
        already, so only the checks that depend on params run again."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.outputs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self.prompts.admit(prompt, params, enable_thinking)
        if params.structured is not None:
            self.compile_grammar(params.structured).result()   # SpecError if it does not compile in bounds
        children = [self._make_request(request_id, i, prompt_ids, params, priority) for i in range(params.n)]
        self.core.add_request(children[0])   # validates the fit; raises before any state changes
        self.outputs.add(request_id, prompt_ids, params, stream, [c.request_id for c in children], children[1:])
        return request_id

    def compile_grammar(self, spec):
        """Start compiling a structured-output spec off this thread. The returned future's result() waits at most
        structured.compile_timeout_s and raises SpecError (a ValueError naming the parameter) on a bad spec; a
        front end may wait for it on its own thread before add_request, which then finds it compiled."""
        from minillm.structured.compiler import grammar_service

        service = grammar_service(self.runner.model_dir, self.runner.vocab_size, self.cfg.structured)
        return _Bounded(service, spec)

    def _make_request(self, rid: str, i: int, prompt_ids, params: SamplingParams, priority: int) -> Request:
        if params.n > 1 and params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + i)   # distinct but reproducible completions
        child_id = rid if params.n == 1 else f"{rid}#{i}"
        return Request(child_id, list(prompt_ids), params, eos_token_ids=self.prompts.eos_token_ids,
                       priority=priority)

    # ---- stepping --------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.core.has_unfinished_requests()

    def step(self) -> list[StepOutput]:
        """One engine step; returns what became visible (see EngineCore.step for the one-step lag of async
        scheduling)."""
        outs, self._pending = self._pending, []
        try:
            core_outputs = self.core.step()
        except RequestsFailed as e:   # a data-parallel replica died: its requests end here, the rest go on
            self._pending = outs
            raise RequestsFailed(str(e), self._drop(e.request_ids)) from None
        return outs + self._process(core_outputs)

    def _drop(self, core_ids: list[str]) -> list[str]:
        """Forget the user requests owning these core requests (their other completions are aborted); returns
        their ids."""
        users = list(dict.fromkeys(u for u in map(self.outputs.owner, core_ids) if u is not None))
        for user in users:
            live, _ = self.outputs.abort(user)
            self.core.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        return users

    def _process(self, core_outputs) -> list[StepOutput]:
        done = self.outputs.process(core_outputs)
        for req in done.admit:
            self.core.add_request(req)
        if done.stopped:
            self.core.finish_requests(done.stopped, RequestStatus.FINISHED_STOPPED)
        return done.outputs

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its completions). Its final StepOutput comes with the next step(). Returns
        False if the id is unknown or already finished."""
        request_id = str(request_id)
        if request_id not in self.outputs:
            return False
        # Every token computed so far is reported before the abort: resolve the step in flight first.
        self._pending += self._process(self.core.drain())
        live, finals = self.outputs.abort(request_id)
        self.core.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self._pending += finals
        return bool(finals)

    # ---- facts -----------------------------------------------------------------------------------------
    @property
    def num_preemptions(self) -> int:
        return self.core.stats().num_preemptions

    def wake(self) -> None:
        """Interrupt a step() waiting on engine-core processes (no-op in-process: its step never waits)."""
        wake = getattr(self.core, "wake", None)
        if wake is not None:
            wake()

    @property
    def in_process(self) -> bool:
        return not isinstance(self.core, CoreClient)

    def check(self, timeout_s: float = 0.0) -> None:
        """Engine-core processes: read their news, waiting up to timeout_s (or until wake()); raise
        EngineDeadError if they are gone. In-process: nothing to check, and no wait."""
        if not self.in_process:
            self.core.check(timeout_s)

    def close(self) -> None:
        """Stop engine-core processes and worker ranks, if any (also done at interpreter exit)."""
        close_core(self.core)

    def stats(self) -> EngineStats:
        return self.core.stats()


class _Bounded:
    """A compile in progress: result() waits for it within the configured bound."""

    def __init__(self, service, spec):
        self.service, self.spec, self.future = service, spec, service.submit(spec)

    def result(self):
        return self.service.compiled(self.spec)
