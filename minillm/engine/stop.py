"""Token-level stop rules of a request, in one place: the scheduler asks these after appending a sampled token.

A request stops on
  - EOS (unless ignore_eos) or one of its stop_token_ids, once it has min_tokens outputs, or earlier when the
    request's grammar is complete ("stop");
  - max_tokens outputs, or max_model_len tokens in all ("length"); a stop by value wins when both hold.
Stop *strings* need the text, so the output processor's detokenizer finds them (minillm/detokenizer.py) and the
engine ends the request in the scheduler (Scheduler.finish_request).

Every step appends a token to hundreds of requests, so the rules come in two tiers: a cheap screen that says
whether a token could stop its request at all (a set lookup and a length compare, precomputed per request in
Request.stop_ids / max_num_tokens), and the full check, run only when the screen fires. At a batch of plain
decodes the screen itself runs per batch (BatchStopScreen).
"""
from __future__ import annotations

from minillm.request import Request, RequestStatus

STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH


def may_stop(req: Request, token: int) -> bool:
    """The screen: False means `token` (just appended) cannot end `req`. max_num_tokens <= max_model_len (the
    scheduler refuses longer requests), so the length half covers both length limits."""
    return token in req.stop_ids or len(req.all_token_ids) >= req.max_num_tokens


def value_stop(req: Request, token: int) -> bool:
    """EOS (unless ignore_eos) or a stop token id, once min_tokens outputs exist: set status and stop_reason."""
    sp = req.sampling_params
    # A constrained request samples EOS below min_tokens only when its grammar is complete (its mask bans EOS
    # otherwise, minillm/structured/rows.py): then the grammar wins and the request stops.
    if len(req.output_token_ids) < sp.min_tokens and sp.structured is None:
        return False
    if not sp.ignore_eos and token in req.eos_token_ids:
        req.status, req.stop_reason = STOPPED, None
        return True
    if token in sp.stop_token_ids:
        req.status, req.stop_reason = STOPPED, token
        return True
    return False


def check_stop(req: Request, token: int, max_model_len: int) -> bool:
    """The full check of the token just appended: set status (and stop_reason) and return True if it ends req."""
    if value_stop(req, token):
        return True
    if len(req.output_token_ids) >= req.sampling_params.max_tokens or len(req.all_token_ids) >= max_model_len:
        req.status = LENGTH
        return True
    return False


class BatchStopScreen:
    """The screen for a run of all-decode steps over one batch, kept at batch level: the union of the rows' stop
    ids and the fewest tokens any row has left before max_num_tokens. Rows are screened one by one only in a step
    where one of these fires (a per-row screen costs ~20 us a step at 256 rows)."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = list(requests)
        self.stop_ids = frozenset().union(*[r.stop_ids for r in requests])
        self.tokens_left = min((r.max_num_tokens - len(r.all_token_ids) for r in requests), default=0)

    def may_stop(self, tokens: list[int]) -> bool:
        """Whether some row could stop on this step's token (one per row), so rows must be screened."""
        return self.tokens_left <= 1 or not self.stop_ids.isdisjoint(tokens)
