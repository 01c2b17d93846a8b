"""LLMEngine: one step = schedule -> execute -> update -> detokenize. Owns the request table.

Data flow is explicit: the Scheduler produces a SchedulerOutput, the ModelRunner turns it into a
ModelRunnerOutput, the Scheduler applies it. The engine alone talks to both and to the tokenizer.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from minillm.config import EngineConfig
from minillm.engine.outputs import (CompletionOutput, EngineStats, ModelRunnerOutput, RequestMetrics, RequestOutput,
                                    StepOutput)
from minillm.engine.prompts import PromptPreparer
from minillm.engine.scheduler import Scheduler
from minillm.request import Request, RequestStatus
from minillm.runner.model_runner import ModelRunner
from minillm.sampling_params import SamplingParams


PLACEHOLDER = -1   # an output token still on the GPU (async scheduling); never a valid token id


@dataclass(eq=False)
class _Completion:
    request: Request
    detok: object | None                 # IncrementalDetokenizer when text is streamed or stop strings exist
    num_reported: int = 0
    logprobs: list | None = None


@dataclass(eq=False)
class _Group:
    """A user request: n completions sharing one prompt (their full prompt blocks are shared via the
    prefix cache) and one metrics record."""
    request_id: str
    prompt_token_ids: list[int]
    completions: list[_Completion]
    metrics: RequestMetrics
    stream: bool
    outputs: list[CompletionOutput | None] = field(default_factory=list)
    # NOTE: completions 1..n-1 wait here until completion 0 has sampled its first token: by then the
    # prompt's full blocks are computed and published, so the siblings take them from the prefix cache
    # instead of computing the same prompt n times.
    held: list[Request] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(o is not None for o in self.outputs)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.runner = ModelRunner(cfg)
        self.max_model_len = self.runner.max_model_len
        self.prompts = PromptPreparer(self.runner.model_dir, self.runner.arch, self.max_model_len,
                                      cfg.scheduler.max_num_seqs)
        self.tokenizer = self.prompts.tokenizer
        self.scheduler = Scheduler(cfg.scheduler, cfg.cache, self.runner.num_blocks, self.max_model_len)
        self._groups: dict[str, _Group] = {}
        self._child: dict[str, tuple[_Group, int]] = {}
        self._pending: list[StepOutput] = []
        self._ids = itertools.count()
        self.profile = None   # a StepProfile (minillm.engine.profile) when a caller wants the breakdown
        self._inflight = None       # async scheduling: (placeholders written by update, launched step)
        self._num_penalty_reqs = 0  # live completions whose sampling reads their own history on the host

    # ---- admission -------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, stream: bool = True, enable_thinking: bool | None = None) -> str:
        """Validate, then admit. Raises ValueError naming the problem; a rejected request leaves no state."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self.prompts.prepare(prompt, params, enable_thinking)
        children = [self._make_request(request_id, i, prompt_ids, params, priority) for i in range(params.n)]
        self.scheduler.add_request(children[0])   # validates the fit; raises before any state changes
        group = _Group(request_id, prompt_ids, [], RequestMetrics(arrival_time=time.perf_counter()), stream,
                       [None] * params.n, held=children[1:])
        for i, req in enumerate(children):
            detok = self.prompts.detokenizer(params) if (stream or params.stop) else None
            group.completions.append(_Completion(req, detok, logprobs=[] if params.logprobs is not None else None))
            self._child[req.request_id] = (group, i)
            self._num_penalty_reqs += params.needs_penalties
        self._groups[request_id] = group
        return request_id

    def _make_request(self, rid: str, i: int, prompt_ids, params: SamplingParams, priority: int) -> Request:
        if params.n > 1 and params.seed is not None:
            params = _with_seed(params, params.seed + i)   # distinct but reproducible completions
        child_id = rid if params.n == 1 else f"{rid}#{i}"
        return Request(child_id, list(prompt_ids), params, eos_token_ids=self.prompts.eos_token_ids,
                       priority=priority)

    # ---- stepping --------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self._inflight is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> list[StepOutput]:
        """One engine step; returns what became visible. With async scheduling (and no request whose
        sampling reads its previous token on the host, i.e. penalties) the step launched here is resolved
        by the next call, so outputs trail the GPU by one step."""
        if self.cfg.runtime.async_scheduling and self._num_penalty_reqs == 0:
            return self._step_async()
        self._drain()
        outs, self._pending = self._pending, []
        so = self._schedule()
        if so.is_empty:
            return outs
        runner_out = self.runner.execute(so, self.profile)
        advanced = self.scheduler.update(so, runner_out)
        outs += self._emit_tokens(advanced, runner_out)
        self._after_step()
        return outs

    def _schedule(self):
        prof = self.profile
        if prof is not None:
            prof.start()
        so = self.scheduler.schedule()
        if prof is not None and not so.is_empty:
            prof.mark("schedule")
            prof.count_step(len(so.requests), so.num_decodes == len(so.requests))
        return so

    def _after_step(self) -> None:
        if self.cfg.runtime.check_integrity:
            self.scheduler.check_integrity()
        if self.profile is not None:
            self.profile.mark("update")

    def _emit_tokens(self, advanced: list[Request], runner_out) -> list[StepOutput]:
        """Stream the new tokens of the requests that advanced; release the rows of those that finished."""
        now = time.perf_counter()
        lps = dict(zip(runner_out.req_ids, runner_out.logprobs)) if runner_out.logprobs else {}
        outs, finished = [], []
        for req in advanced:
            out = self._advance(req, now, lps.get(req.request_id))
            if out is not None:
                outs.append(out)
            if req.is_finished:
                finished.append(req.request_id)
        self.runner.release(finished)
        return outs

    # ---- async scheduling ------------------------------------------------------------------------------
    # Step N: schedule(N) and launch(N) while the GPU still runs N-1; then wait for N-1's tokens, write them
    # over their placeholders and stream them; then update(N) with placeholders (counters, blocks, length
    # stops). A request that stopped at N-1 was still computed in N: that token is dropped, never emitted.

    def _step_async(self) -> list[StepOutput]:
        outs, self._pending = self._pending, []
        so = self._schedule()
        prev = self._inflight[1] if self._inflight is not None else None
        launched = None if so.is_empty else self.runner.launch(so, prev, self.profile)
        outs += self._resolve()
        if launched is not None:
            placeholders = ModelRunnerOutput(launched.req_ids, [PLACEHOLDER] * len(launched.req_ids))
            advanced = self.scheduler.update(so, placeholders)
            # NOTE: requests that update() ended on length left the scheduler's running set, so the next
            # schedule may admit others in their place: free their block-table rows now, not at resolve.
            self.runner.release([r.request_id for r in advanced if r.is_finished])
            self._inflight = ([(r, r.num_output_tokens - 1) for r in advanced], launched)
            self._after_step()
        return outs

    def _resolve(self) -> list[StepOutput]:
        """Wait for the step in flight, fill in its tokens (running the value-dependent stop checks), stream."""
        if self._inflight is None:
            return []
        placed, launched = self._inflight
        self._inflight = None
        runner_out = self.runner.resolve(launched, self.profile)
        token_of = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids))
        for req, out_index in placed:
            self.scheduler.apply_sampled_token(req, out_index, token_of[req.request_id])
        return self._emit_tokens([req for req, _ in placed], runner_out)

    def _drain(self) -> None:
        """Resolve the step in flight (if any) into the pending outputs: before a synchronous step or abort."""
        self._pending += self._resolve()

    def _advance(self, req: Request, now: float, logprob) -> StepOutput | None:
        # NOTE: runs for every request every step (256 x ~1,000 in the bench): keep it to plain attribute work.
        group, idx = self._child[req.request_id]
        comp = group.completions[idx]
        out_ids = req.output_token_ids
        new_ids = out_ids[comp.num_reported:]
        comp.num_reported = len(out_ids)
        if group.held and idx == 0 and (new_ids or req.is_finished):
            for sibling in group.held:
                self.scheduler.add_request(sibling)
            group.held = []
        if new_ids:
            metrics = group.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if idx == 0:
                metrics.token_times += [now] * len(new_ids)
            if logprob is not None and comp.logprobs is not None:
                comp.logprobs.append(logprob)
        text = ""
        detok = comp.detok
        if detok is not None:
            text = detok.add(new_ids)
            if detok.stopped and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if not req.is_finished:
            return StepOutput(group.request_id, new_ids, text, False, None, now, None, idx) if new_ids else None
        return self._emit(group, idx, new_ids, text, now)

    def _emit(self, group: _Group, idx: int, new_ids, text: str, now: float) -> StepOutput:
        """The final StepOutput of a finished completion (and the RequestOutput once all n are done)."""
        comp = group.completions[idx]
        req = comp.request
        if comp.detok is not None:
            text += comp.detok.flush()
            full = comp.detok.text
        else:
            full = self.prompts.decode(req.output_token_ids)
        reason = req.status.value
        group.outputs[idx] = CompletionOutput(idx, full, list(req.output_token_ids), reason, comp.logprobs)
        self._num_penalty_reqs -= req.sampling_params.needs_penalties
        del self._child[req.request_id]
        final = None
        if group.done:
            group.metrics.finished_time = now
            final = RequestOutput(group.request_id, group.prompt_token_ids, group.outputs, group.metrics,
                                  num_cached_tokens=group.completions[0].request.num_cached_tokens)
            del self._groups[group.request_id]
        return StepOutput(group.request_id, list(new_ids), text if group.stream else "", True, reason, now,
                          output=final, index=idx)

    # ---- abort -----------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Abort a request (all its completions). Its final StepOutput comes with the next step(). Returns
        False if the id is unknown or already finished."""
        self._drain()   # no placeholder token may reach a final output
        group = self._groups.get(str(request_id))
        if group is None:
            return False
        now = time.perf_counter()
        for idx, comp in enumerate(group.completions):
            if group.outputs[idx] is None:
                if comp.request in group.held:       # never reached the scheduler
                    comp.request.status = RequestStatus.FINISHED_ABORTED
                self.scheduler.finish_request(comp.request.request_id, RequestStatus.FINISHED_ABORTED)
                self.runner.release([comp.request.request_id])
                self._pending.append(self._emit(group, idx, [], "", now))
        group.held = []
        return True

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(s.num_running, s.num_waiting, s.kv.usage, s.num_preemptions)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)
