"""The data that crosses the scheduler -> runner -> scheduler boundary. Plain dataclasses, no tensors."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress

from minillm.request import Request


@dataclass
class SchedulerOutput:
    """One step's rows, held as columns: at 256 decodes a step, one object per row would cost more than the
    rest of scheduling.

    Row i computes tokens [starts[i], starts[i] + num_tokens[i]) of requests[i].all_token_ids (starts[i] is
    the request's num_computed_tokens when scheduled). sample[i] is True when that chunk reaches the end of
    all_token_ids, so the runner samples a token for the row; False for a non-final prefill chunk.
    """
    # NOTE: order is the runner's row order: all single-token rows (decodes) first, then prefill chunks.
    # The CUDA attention path relies on this to send rows [0, num_decodes) to the decode kernel.
    requests: list[Request] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def num_decodes(self) -> int:
        # Single-token rows come first (see the NOTE above), so they are exactly the leading rows.
        return self.num_tokens.count(1)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def sampled_requests(self) -> list[Request]:
        """The requests that get a token this step, in row order (the order of the runner's output)."""
        if all(self.sample):
            return self.requests
        return list(compress(self.requests, self.sample))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for metrics and admission control (plain data)."""
    num_running: int          # requests (completions) scheduled and holding KV blocks
    num_waiting: int          # queued, not yet running (or preempted)
    kv_cache_usage: float     # fraction of KV blocks in use, 0..1
    num_preemptions: int      # since start


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token plus the top-N alternatives (token id -> logprob)."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    # One entry per sampled row of the SchedulerOutput (SchedulerOutput.sampled_requests()), in row order.
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None


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
