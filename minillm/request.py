"""A request's state as the scheduler sees it. Only the scheduler and the engine core read or mutate it: the
runner keeps its own copy, fed by the plain messages of minillm/contract.py."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minillm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # never scheduled, or preempted (then num_computed_tokens was reset to 0)
    RUNNING = "running"
    FINISHED_STOPPED = "stop"    # EOS, stop token id or stop string
    FINISHED_LENGTH = "length"   # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.WAITING and self is not RequestStatus.RUNNING


# NOTE: slots: the scheduler and the runner read a few attributes of every running request every step, and
# slot access keeps them in the object itself (~5% of the host step at 256 decodes).
@dataclass(eq=False, slots=True, weakref_slot=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    # NOTE: the one counter the scheduler closes against the target (prompt + generated tokens).
    # Chunked prefill, prefix-cache hits and recompute after preemption all move only this counter.
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)   # owned by KVCacheManager
    num_cached_tokens: int = 0       # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    # How many of block_ids the runner has been sent; -1 until the runner first hears of the request.
    num_sent_blocks: int = -1
    stop_reason: int | str | None = None
    sampling_row: bytes = field(init=False, repr=False)
    stop_ids: frozenset[int] = field(init=False, repr=False)
    max_num_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        sp = self.sampling_params
        self.sampling_row = sp.packed_row()   # the sampler's per-row scalars, packed once
        # The scheduler's per-token stop screen, precomputed: a request can only stop on a token in stop_ids
        # or on reaching max_num_tokens (max_tokens outputs). min_tokens and ignore_eos are checked after it.
        self.stop_ids = self.eos_token_ids | frozenset(sp.stop_token_ids)
        self.max_num_tokens = len(self.prompt_token_ids) + sp.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """The target: every token whose KV must exist before the next token can be sampled."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        # NOTE: identity tests, not status.finished: this runs several times per request per step.
        status = self.status
        return status is not RequestStatus.WAITING and status is not RequestStatus.RUNNING

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
