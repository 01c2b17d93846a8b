"""What the engine hands its callers: per-step streaming deltas (StepOutput), finished results (RequestOutput)
and load snapshots (EngineStats). Plain dataclasses, no tensors.

The scheduler <-> runner contract lives in minillm/contract.py; its TokenLogprobs is re-exported here because
callers see it in CompletionOutput.logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.contract import TokenLogprobs  # noqa: F401  (re-exported: callers see it in CompletionOutput)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for metrics and admission control (plain data)."""
    num_running: int          # requests (completions) scheduled and holding KV blocks
    num_waiting: int          # queued, not yet running (or preempted)
    kv_cache_usage: float     # fraction of KV blocks in use, 0..1
    num_preemptions: int      # since start


@dataclass
class CoreOutput:
    """What the engine core reports of one request (one completion of a user request) after a step."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None           # "stop" | "length" | "abort" once it finished, else None
    logprobs: TokenLogprobs | None = None   # of the new token, when the request asked for logprobs
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache at first admission


@dataclass
class CompletionOutput:
    """One generated sequence (a prompt with n > 1 has several)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None           # "stop" | "length" | "abort" | None while running
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float                 # time.perf_counter() when add_request was called
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each output token became visible
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class RequestOutput:
    """Final result for one prompt, returned by LLM.generate (in prompt order)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache (first completion)

    # Convenience accessors for the first (usually only) completion.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs

    def __getitem__(self, key: str):
        """out["text"]-style access, as in seed 000's API."""
        if key in ("request_id", "prompt_token_ids", "outputs", "metrics", "text", "token_ids",
                   "finish_reason", "logprobs", "num_cached_tokens"):
            return getattr(self, key)
        raise KeyError(key)


@dataclass
class StepOutput:
    """What LLM.step() returns for each request that advanced in this step (streaming deltas)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str                       # safe delta: never a split UTF-8 character or part of a stop string
    finished: bool
    finish_reason: str | None
    time: float                         # time.perf_counter() when these tokens became visible
    output: RequestOutput | None = None  # set when the request (all n completions) has finished
    index: int = 0                      # which of the request's n completions advanced
    logprobs: list[TokenLogprobs] | None = None   # of new_token_ids, when the request asked for logprobs
