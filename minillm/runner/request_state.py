"""The runner's own copy of each live request: built from the plain SchedulerOutput messages (minillm/contract.py)
and from the tokens the runner itself samples, never read from the scheduler's objects.

A request's tokens are its prompt plus every token sampled for it, appended when resolve() has them on the host.
Steps resolve in launch order, so each lands exactly at its index. With async scheduling the next step is built
while the last sampled token is still on the device: a decode row whose input position is one past the known
tokens takes that token from the device (minillm/runner/input_batch.py), and the sampler counts outputs from the
row's position rather than from the list (minillm/sampling/batch.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.contract import NewRequestData, SchedulerOutput
from minillm.sampling_params import SamplingParams

PLACEHOLDER = -1   # an input token still on the device; never a valid token id


# NOTE: slots + weakref: the sampler's penalty history is a weak map keyed by the request (sampling/penalties.py),
# and the input builder reads a few attributes of every row every step.
@dataclass(eq=False, slots=True, weakref_slot=True)
class CachedRequest:
    """What the sampler and the input builder read of a request (the same attribute names as the scheduler's
    Request, so sampling code serves both)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    all_token_ids: list[int] = field(init=False)   # prompt + sampled tokens known on the host
    sampling_row: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.sampling_row = self.sampling_params.packed_row()

    @classmethod
    def from_new(cls, new: NewRequestData) -> "CachedRequest":
        return cls(new.req_id, new.prompt_token_ids, new.sampling_params, frozenset(new.eos_token_ids),
                   list(new.block_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)


class RequestStates:
    """Every request the runner knows, by id, kept in step with the scheduler's messages."""

    def __init__(self) -> None:
        self.by_id: dict[str, CachedRequest] = {}
        self._ids: list[str] = []
        self._rows: list[CachedRequest] = []
        self._sampled: list[CachedRequest] | None = None   # append_sampled's last row list and its token lists
        self._lists: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.by_id)

    def apply(self, so: SchedulerOutput) -> list[str]:
        """Apply the step's state changes (in the contract's order); return the ids whose block-table rows must
        be dropped (finished and preempted requests)."""
        dropped = list(so.finished_ids) + list(so.preempted_ids)
        by_id = self.by_id
        for rid in so.finished_ids:
            by_id.pop(rid, None)        # a request the runner never ran may finish too: nothing to forget
        for rid in so.preempted_ids:
            state = by_id.get(rid)
            if state is not None:
                state.block_ids = []    # its blocks were freed; it gets them all anew when it runs again
        for new in so.new_requests:
            if new.req_id in by_id:
                raise ValueError(f"scheduler output introduces request {new.req_id!r}, which the runner already "
                                 "holds (finish it first)")
            by_id[new.req_id] = CachedRequest.from_new(new)
        for rid, blocks in so.new_block_ids.items():
            state = by_id.get(rid)
            if state is None:
                raise ValueError(f"scheduler output adds blocks to request {rid!r}, which the runner does not hold")
            state.block_ids += blocks
        if dropped or so.new_requests:
            self._ids = []              # the cached row list may hold a dropped or replaced request
        return dropped

    def append_sampled(self, sampled: list[CachedRequest], tokens: list[int]) -> None:
        """Record the tokens a step sampled, in launch order (see the module docstring)."""
        # NOTE: at 256 decodes this runs every ~4 ms; the token lists of the same row list as last time are reused
        # and appended to by map() in C (a request's all_token_ids is never replaced, only appended to).
        if sampled is not self._sampled:
            self._sampled, self._lists = sampled, [r.all_token_ids for r in sampled]
        deque(map(list.append, self._lists, tokens), maxlen=0)

    def rows(self, req_ids: list[str]) -> list[CachedRequest]:
        """The state of each row's request, in row order. Do not modify the list."""
        # NOTE: consecutive decode steps usually name the very same requests: compare the id lists (in C) and
        # reuse the last row list instead of 256 dict lookups.
        if req_ids != self._ids:
            by_id = self.by_id
            try:
                self._rows = [by_id[rid] for rid in req_ids]
            except KeyError as e:
                raise ValueError(f"scheduler output schedules request {e.args[0]!r}, which the runner does not "
                                 "hold") from None
            self._ids = list(req_ids)
        return self._rows
