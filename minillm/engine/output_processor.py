"""OutputProcessor: turns the engine core's token outputs into what callers see: streamed text deltas, finished
RequestOutputs, n > 1 groups and per-request metrics. It owns the detokenizers, so stop strings are found here;
it tells the engine which completions they ended, and the engine ends them in the core.

A user request with n > 1 is a group of n core requests ("<id>#<i>") that share the prompt. Completions 1..n-1
are held back until completion 0 has its first token: by then the prompt's full blocks are computed and
published, so the siblings take them from the prefix cache instead of computing the same prompt n times.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from minillm.engine.outputs import CompletionOutput, CoreOutput, RequestMetrics, RequestOutput, StepOutput


@dataclass(eq=False)
class _Completion:
    detok: object | None                 # IncrementalDetokenizer when text is streamed or stop strings exist
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None


@dataclass(eq=False)
class _Group:
    request_id: str
    prompt_token_ids: list[int]
    child_ids: list[str]                 # the core request id of each completion
    completions: list[_Completion]
    metrics: RequestMetrics
    stream: bool
    held: list                           # core Requests of completions 1..n-1 not yet admitted
    outputs: list[CompletionOutput | None] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return all(o is not None for o in self.outputs)


@dataclass
class Processed:
    """What one batch of core outputs produced, and what the engine must do in the core as a result."""
    outputs: list[StepOutput] = field(default_factory=list)
    admit: list = field(default_factory=list)        # held sibling Requests to add to the core now
    stopped: list[str] = field(default_factory=list)  # core request ids a stop string ended


class OutputProcessor:
    def __init__(self, prompts) -> None:
        self.prompts = prompts      # PromptPreparer: detokenizers and full-text decoding
        self._groups: dict[str, _Group] = {}
        self._child: dict[str, tuple[_Group, int]] = {}   # live core request id -> (group, completion index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, request_id: str, prompt_ids: list[int], params, stream: bool, child_ids: list[str],
            held: list) -> None:
        """Track a user request whose core requests are child_ids (the first one admitted, `held` the rest)."""
        group = _Group(request_id, prompt_ids, list(child_ids), [], RequestMetrics(arrival_time=time.perf_counter()), stream,
                       held=held, outputs=[None] * len(child_ids))
        for i, child_id in enumerate(child_ids):
            detok = self.prompts.detokenizer(params) if (stream or params.stop) else None
            group.completions.append(_Completion(detok, logprobs=[] if params.logprobs is not None else None))
            self._child[child_id] = (group, i)
        self._groups[request_id] = group

    def owner(self, core_request_id: str) -> str | None:
        """The user request a live core request belongs to."""
        entry = self._child.get(core_request_id)
        return None if entry is None else entry[0].request_id

    def process(self, core_outputs: list[CoreOutput]) -> Processed:
        done = Processed()
        now = time.perf_counter()
        child, advance, outputs = self._child, self._advance, done.outputs
        for out in core_outputs:
            entry = child.get(out.request_id)
            if entry is None:            # a completion already ended (stop string, abort)
                continue
            group, idx = entry
            new_ids = out.new_token_ids
            # NOTE: the common row, once per request per step, inline: one token of a single completion that
            # goes on, no logprobs, its first token already seen. The rest goes through _advance.
            if (idx == 0 and len(new_ids) == 1 and out.finish_reason is None and out.logprobs is None
                    and not group.held and group.metrics.first_token_time is not None):
                comp = group.completions[0]
                comp.token_ids.append(new_ids[0])
                group.num_cached_tokens = out.num_cached_tokens
                group.metrics.token_times.append(now)
                detok = comp.detok
                if detok is None:
                    outputs.append(StepOutput(group.request_id, new_ids, "", False, None, now))
                    continue
                text = detok.add(new_ids)
                if not detok.stopped:
                    outputs.append(StepOutput(group.request_id, new_ids, text, False, None, now))
                    continue
                done.stopped.append(out.request_id)     # a stop string ended it
                del child[out.request_id]
                outputs.append(self._final(group, 0, new_ids, text, "stop", now))
                continue
            advance(group, idx, out, now, done)
        return done

    def _advance(self, group: _Group, idx: int, out: CoreOutput, now: float, done: Processed) -> None:
        # NOTE: process() takes the common row inline; this is every other one (n > 1, logprobs, finishing,
        # first token), still kept to plain attribute work.
        comp = group.completions[idx]
        new_ids = out.new_token_ids
        comp.token_ids += new_ids
        metrics = group.metrics
        if idx == 0:
            group.num_cached_tokens = out.num_cached_tokens
            if group.held:
                done.admit += group.held
                group.held = []
            if new_ids:
                token_times = metrics.token_times
                if len(new_ids) == 1:
                    token_times.append(now)
                else:
                    token_times += [now] * len(new_ids)
        new_lps = None
        if new_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if out.logprobs is not None and comp.logprobs is not None:
                comp.logprobs.append(out.logprobs)
                new_lps = [out.logprobs]
        text, reason = "", out.finish_reason
        detok = comp.detok
        if detok is not None:
            text = detok.add(new_ids)
            if detok.stopped and reason is None:
                reason = "stop"
                done.stopped.append(out.request_id)
        if reason is None:
            if new_ids:
                done.outputs.append(StepOutput(group.request_id, new_ids, text, False, None, now, None, idx,
                                               new_lps))
            return
        del self._child[out.request_id]
        done.outputs.append(self._final(group, idx, new_ids, text, reason, now, new_lps))

    def abort(self, request_id: str) -> tuple[list[str], list[StepOutput]]:
        """End every unfinished completion of a user request: (their core request ids, their final outputs)."""
        group = self._groups.get(request_id)
        if group is None:
            return [], []
        now = time.perf_counter()
        live = [cid for cid in group.child_ids if cid in self._child]
        finals = []
        for cid in live:
            idx = self._child.pop(cid)[1]
            finals.append(self._final(group, idx, [], "", "abort", now))
        group.held = []
        return live, finals

    def _final(self, group: _Group, idx: int, new_ids, text: str, reason: str, now: float,
               new_lps=None) -> StepOutput:
        """The final StepOutput of a completion (carrying the RequestOutput once all n are done)."""
        comp = group.completions[idx]
        if comp.detok is not None:
            text += comp.detok.flush()
            full = comp.detok.text
        else:
            full = self.prompts.decode(comp.token_ids)
        group.outputs[idx] = CompletionOutput(idx, full, list(comp.token_ids), reason, comp.logprobs)
        final = None
        if group.done:
            group.metrics.finished_time = now
            final = RequestOutput(group.request_id, group.prompt_token_ids, group.outputs, group.metrics,
                                  num_cached_tokens=group.num_cached_tokens)
            del self._groups[group.request_id]
        return StepOutput(group.request_id, list(new_ids), text if group.stream else "", True, reason, now,
                          output=final, index=idx, logprobs=new_lps)
