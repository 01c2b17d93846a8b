"""The data that crosses the scheduler -> runner -> scheduler boundary. Plain dataclasses, no tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.request import Request


@dataclass
class ScheduledSeq:
    """One request's share of a step: compute tokens [start, start + num_tokens) of request.all_token_ids."""
    request: Request
    start: int               # == request.num_computed_tokens when scheduled
    num_tokens: int
    # True when this chunk reaches the end of all_token_ids: the runner samples a token for it.
    # False for a non-final prefill chunk (its logits are not needed).
    sample: bool

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1


@dataclass
class SchedulerOutput:
    # NOTE: order is the runner's row order: all single-token rows (decodes) first, then prefill chunks.
    # The CUDA attention path relies on this to send rows [0, num_decodes) to the decode kernel.
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def num_decodes(self) -> int:
        n = 0
        for s in self.scheduled:
            if s.num_tokens != 1:
                break
            n += 1
        return n

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token plus the top-N alternatives (token id -> logprob)."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    # One entry per ScheduledSeq with sample=True, in schedule order.
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
