"""EngineCore: the step loop. One step = schedule -> execute (the runner) -> update; requests in, CoreOutputs out.

The core knows token ids only: no tokenizer, no text, no n > 1 groups, no metrics (that is the output processor's
job, minillm/engine/output_processor.py), so it can run on its own, e.g. in a process of its own behind an HTTP
front end. Everything it sends the runner is the plain SchedulerOutput of minillm/contract.py; `recorder`, when
set, sees each one before the runner does (the record/replay test uses it).
"""
from __future__ import annotations

from minillm.config import EngineConfig
from minillm.contract import ModelRunnerOutput, SchedulerOutput
from minillm.engine.outputs import CoreOutput, EngineStats
from minillm.engine.scheduler import Scheduler
from minillm.request import Request, RequestStatus

PLACEHOLDER = -1   # an output token still on the device (async scheduling); never a valid token id
_RUNNING, _WAITING = RequestStatus.RUNNING, RequestStatus.WAITING


class EngineCore:
    def __init__(self, cfg: EngineConfig, runner=None):
        from minillm.runner.model_runner import ModelRunner   # lazy: the torch-heavy part

        self.cfg = cfg
        self.runner = runner if runner is not None else ModelRunner(cfg)
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(cfg.scheduler, cfg.cache, self.runner.num_blocks, self.max_model_len)
        self.profile = None        # a StepProfile (minillm.engine.profile) when a caller wants the breakdown
        self.recorder = None       # callable(SchedulerOutput), called before the runner gets each step
        # Async scheduling: (requests update() gave a placeholder, each one's output index, the launched step).
        self._inflight = None
        self._pending: list[CoreOutput] = []   # resolved outside step(): returned by the next step()
        # Live requests whose sampling reads their own history on the host (penalties): they need synchronous steps.
        self._penalty_ids: set[str] = set()

    # ---- requests in and out -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; raises ValueError (and changes nothing) if it could never run."""
        self.scheduler.add_request(req)
        if req.sampling_params.needs_penalties:
            self._penalty_ids.add(req.request_id)

    def finish_requests(self, req_ids, status: RequestStatus) -> list[str]:
        """End requests now (abort, or a stop string the output processor found); return those that were live.
        A token of theirs still in flight is dropped when it lands (the scheduler ignores finished requests)."""
        ended = []
        for rid in req_ids:
            if self.scheduler.finish_request(rid, status) is not None:
                ended.append(rid)
            self._penalty_ids.discard(rid)
        self._flush_if_idle()
        return ended

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self._inflight is not None or self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(s.num_running, s.num_waiting, s.kv.usage, s.num_preemptions)

    # ---- stepping ------------------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """One step; returns the tokens that became visible. With async scheduling (and no live request whose
        sampling reads its history on the host) the step launched here is resolved by the next call, so outputs
        trail the GPU by one step."""
        outs, self._pending = self._pending, []
        if self.cfg.runtime.async_scheduling and not self._penalty_ids:
            outs += self._step_async()
        else:
            outs += self._step_sync()
        self._flush_if_idle()
        outs, self._pending = outs + self._pending, []
        return outs

    def _flush_if_idle(self) -> None:
        """Once no request is left to schedule, wait for the step in flight (nothing is left to overlap it with),
        and tell the runner what finished with an empty step, so that nothing lingers while the engine idles."""
        if self.scheduler.has_unfinished_requests():
            return
        self._pending += self.drain()
        self._schedule()

    def _step_sync(self) -> list[CoreOutput]:
        outs = self.drain()
        so = self._schedule()
        if so.is_empty:
            return outs
        runner_out = self.runner.execute(so, self.profile)
        advanced = self.scheduler.update(so, runner_out)
        outs += self._outputs(advanced, runner_out)
        self._after_step()
        return outs

    def _schedule(self) -> SchedulerOutput:
        prof = self.profile
        if prof is not None:
            prof.start()
        so = self.scheduler.schedule()
        if self.recorder is not None:
            self.recorder(so)
        if so.is_empty:
            if so.finished_ids or so.preempted_ids:
                self.runner.update_states(so)    # no step to run, but the runner forgets what ended
        elif prof is not None:
            prof.mark("schedule")
            prof.count_step(len(so.req_ids), so.num_decodes == len(so.req_ids))
        return so

    def _after_step(self) -> None:
        if self.cfg.runtime.check_integrity:
            self.scheduler.check_integrity()
        if self.profile is not None:
            self.profile.mark("update")

    def _outputs(self, advanced: list[Request], runner_out: ModelRunnerOutput) -> list[CoreOutput]:
        """One CoreOutput per request that got a token: the token, and the finish reason if it ended."""
        lps = dict(zip(runner_out.req_ids, runner_out.logprobs)) if runner_out.logprobs else None
        outs = []
        append = outs.append
        # NOTE: once per request per step: Request.is_finished inlined, the common case first.
        for req in advanced:
            status, rid = req.status, req.request_id
            if status is _RUNNING or status is _WAITING:
                reason = None
            else:
                reason = status.value
                self._penalty_ids.discard(rid)
            append(CoreOutput(rid, [req.output_token_ids[-1]], reason, lps.get(rid) if lps else None,
                              req.num_cached_tokens))
        return outs

    # ---- async scheduling ----------------------------------------------------------------------------------
    # Step N: schedule(N) and launch(N) while the GPU still runs N-1; then wait for N-1's tokens, write them over
    # their placeholders and report them; then update(N) with placeholders (counters, blocks, length stops). A
    # request that stopped at N-1 was still computed in N: that token is dropped, never reported.

    def _step_async(self) -> list[CoreOutput]:
        so = self._schedule()
        prev = self._inflight[-1] if self._inflight is not None else None
        launched = None if so.is_empty else self.runner.launch(so, prev, self.profile)
        outs = self._resolve()
        if launched is not None:
            placeholders = ModelRunnerOutput(launched.req_ids, [PLACEHOLDER] * len(launched.req_ids))
            advanced = self.scheduler.update(so, placeholders)
            self._inflight = (advanced, [len(r.output_token_ids) - 1 for r in advanced], launched)
            self._after_step()
        return outs

    def _resolve(self) -> list[CoreOutput]:
        """Wait for the step in flight, fill in its tokens (running the value-dependent stop checks), report."""
        if self._inflight is None:
            return []
        placed, out_indices, launched = self._inflight
        self._inflight = None
        runner_out = self.runner.resolve(launched, self.profile)
        tokens = runner_out.sampled_token_ids
        if len(placed) != len(tokens):
            # Some rows finished between schedule and update: placed is the rest, in row order.
            token_of = dict(zip(runner_out.req_ids, tokens))
            tokens = [token_of[req.request_id] for req in placed]
        self.scheduler.apply_sampled_tokens(placed, out_indices, tokens)
        return self._outputs(placed, runner_out)

    def drain(self) -> list[CoreOutput]:
        """Resolve the step in flight, if any, and return its outputs (before a synchronous step, or before an
        abort that should report every token computed so far)."""
        return self._resolve()
