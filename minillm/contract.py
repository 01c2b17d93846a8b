"""The plain-data contract of one engine step: what the scheduler tells the model runner (SchedulerOutput) and
what the runner hands back (ModelRunnerOutput).

Only ints, strings, lists, dicts and the plain SamplingParams dataclass cross this boundary, never a live
scheduler object, so the same messages can drive a runner in another process (a tensor-parallel worker, an
engine core behind an HTTP front end) after a pickle round trip. The runner keeps its own copy of each request's
state (prompt, sampled tokens, block ids), built from the first message that names the request and updated by
the later ones, the way vLLM's workers keep their input batch.

Neither side imports the other: the scheduler (minillm/engine/) and the runner (minillm/runner/) both import
this module. SamplingRow is what the sampler (minillm/sampling/) reads of a row, so it needs neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import Protocol

from minillm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen yet: everything it keeps about it."""
    req_id: str
    prompt_token_ids: list[int]          # never mutated after the request is created
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]        # for the min_tokens ban
    block_ids: list[int]                 # the KV blocks it holds when first scheduled


@dataclass
class SchedulerOutput:
    """One step's rows, as columns (at 256 decodes a step, one object per row would cost more than the rest of
    scheduling), plus the changes to the runner's request state since the previous step.

    Row i computes tokens [starts[i], starts[i] + num_tokens[i]) of request req_ids[i] (starts[i] is its
    num_computed_tokens when scheduled). sample[i] is True when that chunk reaches the end of the request's
    tokens, so the runner samples a token for the row; False for a non-final prefill chunk.

    The runner applies the state changes in this order before building the step: forget finished_ids; drop the
    KV blocks of preempted_ids (the request stays known: it is recomputed from its tokens when it runs again,
    and then gets all its blocks anew through new_block_ids); add new_requests; append new_block_ids.
    """
    # NOTE: order is the runner's row order: all single-token rows (decodes) first, then prefill chunks.
    # The CUDA attention path relies on this to send rows [0, num_decodes) to the decode kernel.
    req_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)   # known requests' blocks added since
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    step_id: int = 0                     # the scheduler's step counter: update() checks it gets its own step

    @property
    def num_decodes(self) -> int:
        # Single-token rows come first (see the NOTE above), so they are exactly the leading rows.
        return self.num_tokens.count(1)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids

    def sampled_req_ids(self) -> list[str]:
        """The requests that get a token this step, in row order (the order of the runner's output)."""
        if all(self.sample):
            return self.req_ids
        return list(compress(self.req_ids, self.sample))


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token plus the top-N alternatives (token id -> logprob)."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    # One entry per sampled row of the SchedulerOutput (SchedulerOutput.sampled_req_ids()), in row order.
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None


class SamplingRow(Protocol):
    """What the sampler reads of a row's request: the runner's CachedRequest (minillm/runner/request_state.py)
    satisfies it. It must also be weak-referenceable (the penalty history is keyed weakly by it)."""
    prompt_token_ids: list[int]
    all_token_ids: list[int]             # prompt + sampled tokens known on the host
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    sampling_row: bytes                  # SamplingParams.packed_row()

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...
