"""Continuous-batching scheduler: one rule, num_computed_tokens against the target request.num_tokens.

Each step hands out at most max_num_batched_tokens tokens:
  1. running decodes (1 token each),
  2. running partial prefills (chunks, capped by long_prefill_token_threshold when > 0),
  3. waiting requests in policy order while max_num_seqs and the budget allow (a prefix-cache hit moves
     num_computed_tokens forward at admission).
Chunked prefill, prefix hits and recompute after preemption all just move that one counter.

enable_chunked_prefill=False is the prefill-first baseline: a step holds either whole prompts (admitted only
if they fit the remaining budget) or, when no prompt can be admitted, every running decode. A prompt longer
than the whole budget would never fit, so it runs alone in budget-sized chunks over consecutive steps
(the budget is never exceeded: the runner sizes its buffers by it).

policy="static" admits a new batch (up to max_num_seqs requests) only when nothing is running; the batch is
then prefilled and decoded by the phases above until every member finished. Admission never preempts.

At high concurrency most steps are plain decodes of the very requests of the step before. update() then
leaves them for the next schedule(), which takes them all without a pass over the requests (it only visits
those whose last block is full), and screens stop conditions per batch rather than per row. These shortcuts
decide exactly what the row-by-row paths decide (tests/test_scheduler_properties.py compares the two).

The scheduler never touches tensors; the runner never mutates scheduler state. What the runner learns of a step
is the plain SchedulerOutput of minillm/contract.py: rows by request id, plus the requests, blocks, finishes and
preemptions it has not heard of yet (each request remembers how many of its block ids were sent).
"""
from __future__ import annotations

from typing import NamedTuple

from minillm.cache.kv_cache_manager import KVCacheManager
from minillm.config import CacheConfig, SchedulerConfig
from minillm.contract import ModelRunnerOutput, NewRequestData, SchedulerOutput
from minillm.engine.policy import insert_running, make_waiting_queue
from minillm.engine.stop import BatchStopScreen, check_stop, may_stop, value_stop
from minillm.request import Request, RequestStatus

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING


class _Rows:
    """Rows of a step as columns, the way SchedulerOutput holds them."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.starts: list[int] = []
        self.num_tokens: list[int] = []
        self.sample: list[bool] = []

    def append(self, req: Request, start: int, num_tokens: int, sample: bool) -> None:
        self.requests.append(req)
        self.starts.append(start)
        self.num_tokens.append(num_tokens)
        self.sample.append(sample)

    def extend_decodes(self, reqs: list[Request], starts: list[int]) -> None:
        """Plain decodes: one token each, and each samples."""
        self.requests += reqs
        self.starts += starts
        self.num_tokens += [1] * len(reqs)
        self.sample += [True] * len(reqs)

    def remove(self, req: Request) -> int:
        """Take req's row out; return its token count (0 when req has no row here)."""
        for i, r in enumerate(self.requests):
            if r is req:
                del self.requests[i], self.starts[i], self.sample[i]
                return self.num_tokens.pop(i)
        return 0


class _StepPlan:
    """The SchedulerOutput under construction: rows split into single-token rows and longer chunks."""

    def __init__(self, budget: int) -> None:
        self.full_budget = budget
        self.budget = budget
        self.decodes = _Rows()   # single-token rows (decodes, or a 1-token final chunk)
        self.chunks = _Rows()    # multi-token prefill chunks
        self.preempted_ids: list[str] = []
        # Set by the all-decodes fast path: the only rows whose block lists may have grown, as long as the plan
        # still has just its fast_rows rows (admission may add rows after it).
        self.grown: list[Request] | None = None
        self.fast_rows = 0

    @property
    def is_empty(self) -> bool:
        return not self.decodes.requests and not self.chunks.requests

    def add(self, req: Request, num_tokens: int) -> None:
        start = req.num_computed_tokens
        rows = self.decodes if num_tokens == 1 else self.chunks
        rows.append(req, start, num_tokens, start + num_tokens == len(req.all_token_ids))
        self.budget -= num_tokens

    def drop(self, req: Request) -> None:
        """Take a preempted request's row back out (it was scheduled earlier in this step) and refund it."""
        self.budget += self.decodes.remove(req) or self.chunks.remove(req)

    def rows(self) -> tuple[list[Request], SchedulerOutput]:
        """The rows in runner order (requests, and the row columns of the output; state changes not filled in)."""
        # NOTE: all single-token rows first; the attention backend sends rows [0, num_decodes) to decode.
        d, c = self.decodes, self.chunks
        reqs = d.requests + c.requests
        return reqs, SchedulerOutput([r.request_id for r in reqs], d.starts + c.starts, d.num_tokens + c.num_tokens,
                                     d.sample + c.sample, preempted_ids=self.preempted_ids,
                                     num_batched_tokens=self.full_budget - self.budget)


class _Decoding(NamedTuple):
    """What an update() of plain decodes leaves for the next schedule()."""
    requests: list[Request]      # got a token and still run, in row order: each is now a 1-token decode
    full: list[Request]          # those of them whose last block is full


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int, max_model_len: int) -> None:
        sched.validate()
        cache.validate()
        self.config = sched
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, max_model_len)
        self.requests: dict[str, Request] = {}     # every unfinished request, waiting or running
        self.waiting = make_waiting_queue(sched.policy)
        self.running: list[Request] = []           # service order; the preemption victim is the last one
        self.num_preemptions = 0
        # Left by an update() of plain decodes for the next schedule() only. When its requests are exactly the
        # running list, the decode phase needs no pass over the requests.
        self._decoding: _Decoding | None = None
        self._screen: BatchStopScreen | None = None  # valid while every update() is a plain-decode one of its batch
        self._step_id = 0
        self._scheduled: list[Request] = []        # the rows of the last schedule(), for its update()
        self._finished_ids: list[str] = []         # finished since the last output, that the runner knows

    # ---- requests in and out ------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request; refuse one that could never finish, so no request waits forever."""
        rid = req.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        if req.status is not WAITING or req.num_computed_tokens or req.output_token_ids or req.block_ids:
            raise ValueError(f"request {rid!r} is not new (status {req.status.value})")
        num_prompt, max_tokens = req.num_prompt_tokens, req.sampling_params.max_tokens
        if num_prompt == 0:
            raise ValueError(f"request {rid!r}: prompt is empty; it needs at least 1 token")
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt + max_tokens} exceeds max_model_len={self.max_model_len}")
        # The last sampled token's KV is never computed, so the request needs prompt + max_tokens - 1 slots.
        need = self.kv.blocks_needed(num_prompt + max_tokens - 1)
        if need > self.kv.num_blocks:
            raise ValueError(f"request {rid!r}: prompt + max_tokens needs {need} KV blocks of {self.block_size} "
                             f"tokens, but the whole KV pool has {self.kv.num_blocks}")
        self.requests[rid] = req
        self.waiting.push(req)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """End a waiting or running request now (abort, stop string) and free its blocks; None if unknown."""
        if not status.finished:
            raise ValueError(f"status must be a finished status, got {status}")
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status is WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        req.status = status
        self._forget(req)
        return req

    def abort(self, req_id: str) -> bool:
        return self.finish_request(req_id, RequestStatus.FINISHED_ABORTED) is not None

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- schedule -----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's rows (module docstring: phases and modes). Mutates only scheduler state."""
        plan = _StepPlan(self.config.max_num_batched_tokens)
        decoding, self._decoding = self._decoding, None
        admit = self.config.policy != "static"
        if not admit and not self.running:
            self._admit_static_batch()
        if self.config.enable_chunked_prefill:
            prefills = self._schedule_decodes(plan, decoding)
            self._schedule_prefills(plan, prefills, whole=False)
            # NOTE: no admission in a step that preempted: memory is short, and a request preempted just now
            # would otherwise be readmitted at once.
            if admit and not plan.preempted_ids:
                self._admit_waiting(plan, whole=False)
        else:
            prefills = [r for r in self.running if len(r.all_token_ids) - r.num_computed_tokens > 1]
            self._schedule_prefills(plan, prefills, whole=True)
            if admit and not plan.preempted_ids:
                self._admit_waiting(plan, whole=True)
            if plan.is_empty:
                self._schedule_decodes(plan, decoding)
        return self._publish(plan)

    def _publish(self, plan: _StepPlan) -> SchedulerOutput:
        """The step as the runner's plain message: its rows, plus what the runner has not heard of yet."""
        reqs, out = plan.rows()
        self._step_id += 1
        self._scheduled = reqs
        out.step_id = self._step_id
        # NOTE: sent even by a step with no rows, so an idle runner forgets finished requests too.
        out.finished_ids, self._finished_ids = self._finished_ids, []
        new, grown = out.new_requests, out.new_block_ids
        fast = plan.grown is not None and len(reqs) == plan.fast_rows
        for req in (plan.grown if fast else reqs):
            if req.status is not RUNNING:
                continue                 # the fast path's grown list can hold a request preempted since
            sent = req.num_sent_blocks
            if sent < 0:                 # first time the runner hears of it
                new.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                                          req.eos_token_ids, list(req.block_ids)))
            elif len(req.block_ids) != sent:
                grown[req.request_id] = req.block_ids[sent:]
            else:
                continue
            req.num_sent_blocks = len(req.block_ids)
        return out

    def _schedule_decodes(self, plan: _StepPlan, decoding: _Decoding | None) -> list[Request]:
        """Give each running decode its one token; return the running requests that still prefill.

        `decoding`: what the last update() left in self._decoding.
        """
        # NOTE: list == compares element identity in C. Equal means nothing joined, left or was preempted
        # since update(), so every running request is a decode.
        if decoding is not None and len(decoding.requests) <= plan.budget and decoding.requests == self.running:
            self._schedule_all_decodes(plan, decoding.full)
            return []
        prefills, reqs, starts = [], [], []
        bs, budget = self.block_size, plan.budget
        # NOTE: iterating the live list is safe: during this loop preemption only pops its last element
        # (an unvisited request or the current one), which just ends the iteration earlier. No row scheduled
        # here is ever taken back, so the local budget stays exact, and the rows can join the plan at the end.
        for req in self.running:
            start = req.num_computed_tokens
            if len(req.all_token_ids) - start != 1:
                prefills.append(req)
                continue
            if budget == 0:
                break
            # Inline capacity test (the common case) saves a call per decode; allocate_slots re-checks.
            if len(req.block_ids) * bs <= start and not self._allocate(req, 1, plan):
                break                    # req preempted itself: it was the last running request
            reqs.append(req)
            starts.append(start)
            budget -= 1
        plan.decodes.extend_decodes(reqs, starts)
        plan.budget = budget
        return prefills

    def _schedule_all_decodes(self, plan: _StepPlan, full: list[Request]) -> None:
        """_schedule_decodes' loop when every running request is a decode and the budget holds them all: the
        same rows, blocks and preemptions, with only the requests whose last block is full (`full`) visited."""
        running = self.running
        starts = [r.num_computed_tokens for r in running]
        if not self.kv.append_blocks(full):
            # Short of blocks: one at a time, preempting as the loop would. A victim is always the last running
            # request, so once one of these was preempted, so was every later one.
            for req in full:
                if req.status is not RUNNING or not self._allocate(req, 1, plan):
                    break
        n = len(running)
        plan.decodes.extend_decodes(running[:n], starts[:n])
        plan.budget -= n
        plan.grown, plan.fast_rows = full, n

    def _schedule_prefills(self, plan: _StepPlan, prefills: list[Request], whole: bool) -> None:
        """Next chunk of each running partial prefill, in service order, while the budget lasts."""
        for req in prefills:
            if req.status is not RUNNING:
                continue                 # preempted in this step
            n = self._chunk(len(req.all_token_ids) - req.num_computed_tokens, plan, whole)
            if n == 0:
                break
            if self._allocate(req, n, plan):
                plan.add(req, n)

    def _admit_waiting(self, plan: _StepPlan, whole: bool) -> None:
        """Admit waiting requests in policy order; stop at the first that does not fit (no overtaking)."""
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            num_cached = self.kv.get_computed_blocks(req)
            n = self._chunk(len(req.all_token_ids) - num_cached, plan, whole)
            if n == 0 or not self.kv.allocate_slots(req, n, num_cached):
                break
            self.waiting.pop()
            self._start_running(req, num_cached)
            plan.add(req, n)

    def _admit_static_batch(self) -> None:
        """Static batching: move up to max_num_seqs waiting requests to running with no tokens yet.

        Only their prefix hits are taken now; the prefill phase hands them chunks in this and later steps.
        """
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            num_cached = self.kv.get_computed_blocks(req)
            if not self.kv.allocate_slots(req, 0, num_cached):
                break
            self.waiting.pop()
            self._start_running(req, num_cached)

    def _chunk(self, remaining: int, plan: _StepPlan, whole: bool) -> int:
        """Tokens to give a request with `remaining` tokens to compute; 0 = it does not fit this step."""
        if whole:
            if remaining <= plan.budget:
                return remaining
            # Longer than the whole budget: it could never run whole, so it runs alone in budget-sized chunks.
            return plan.budget if plan.is_empty else 0
        n = min(remaining, plan.budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _start_running(self, req: Request, num_cached: int) -> None:
        req.num_computed_tokens = num_cached
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_cached
        req.status = RUNNING
        insert_running(self.running, req, self.config.policy)

    # ---- preemption ---------------------------------------------------------------------------------------

    def _allocate(self, req: Request, num_new_tokens: int, plan: _StepPlan) -> bool:
        """Allocate for a running request, preempting victims until it fits; False if req itself was preempted."""
        while not self.kv.allocate_slots(req, num_new_tokens):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                # add_request guarantees one request alone fits the pool; getting here is a bookkeeping bug.
                raise RuntimeError(f"request {req.request_id} cannot fit the KV pool even alone "
                                   f"({self.kv.num_free_blocks} of {self.kv.num_blocks} blocks free)")
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        """Free the victim's blocks and send it back to wait; it will recompute from token 0 (or a prefix hit)."""
        self.running.pop()               # NOTE: the victim is always the last running request
        plan.drop(victim)
        self.kv.free(victim)
        if victim.num_sent_blocks > 0:
            victim.num_sent_blocks = 0   # the runner drops its blocks (preempted_ids) and gets them anew
        victim.num_computed_tokens = 0
        victim.status = WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(victim)
        plan.preempted_ids.append(victim.request_id)

    # ---- update -------------------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Apply a finished step: advance counters, append sampled tokens, publish full blocks, stop, free.

        Returns the requests that got a token (finished ones included) in schedule order.
        """
        if out.step_id != self._step_id:
            raise ValueError(f"update() got step {out.step_id}, but the last schedule() was step {self._step_id}")
        reqs = self._scheduled
        self._check_runner_output(out, runner_out)
        if out.num_decodes == len(reqs) and all(out.sample):
            return self._update_decodes(reqs, out, runner_out.sampled_token_ids)
        return self._update_rows(reqs, out, runner_out.sampled_token_ids)

    def _update_rows(self, reqs: list[Request], out: SchedulerOutput, tokens: list[int]) -> list[Request]:
        """update() of any step, row by row."""
        self._screen = None
        bs, caching, kv, max_len = self.block_size, self.kv.enable_caching, self.kv, self.max_model_len
        advanced: list[Request] = []
        any_finished = False
        j = 0
        for req, start, num_tokens, sample in zip(reqs, out.starts, out.num_tokens, out.sample):
            if sample:
                token = tokens[j]
                j += 1
            if req.status is not RUNNING:
                continue             # finished (e.g. aborted) between schedule() and update()
            if req.num_computed_tokens != start:
                raise ValueError(f"request {req.request_id}: step applied twice or out of order")
            end = req.num_computed_tokens = start + num_tokens
            if caching and end // bs != start // bs:   # a block just filled
                kv.cache_full_blocks(req, end)
            if not sample:
                continue
            req.append_output_token(token)
            if may_stop(req, token) and check_stop(req, token, max_len):
                any_finished = True
                self._release(req)
            advanced.append(req)
        if any_finished:
            # NOTE: finished requests leave the running list here, in one pass, not one list.remove each.
            self.running = [r for r in self.running if r.status is RUNNING]
        return advanced

    def _update_decodes(self, reqs: list[Request], out: SchedulerOutput, tokens: list[int]) -> list[Request]:
        """_update_rows() of a step whose rows are all 1-token decodes that sample (the common step at high
        concurrency): the same effects with less work per row. Also leaves self._decoding for the next step."""
        bs, kv, max_len = self.block_size, self.kv if self.kv.enable_caching else None, self.max_model_len
        screen = self._screen
        if screen is None or screen.requests != reqs:
            screen = BatchStopScreen(reqs)
        screen_rows = screen.may_stop(tokens)
        full, skipped = [], []
        any_finished = False
        for req, start, token in zip(reqs, out.starts, tokens):
            if req.status is not RUNNING:
                skipped.append(req)  # finished (e.g. aborted) between schedule() and update()
                continue
            if req.num_computed_tokens != start:
                raise ValueError(f"request {req.request_id}: step applied twice or out of order")
            end = req.num_computed_tokens = start + 1
            if end % bs == 0:        # a block just filled: publish it; the next decode needs a new one
                if kv is not None:
                    kv.cache_full_blocks(req, end)
                if len(req.block_ids) * bs <= end:
                    full.append(req)
            # NOTE: Request.append_output_token inlined: a call per row costs ~15 us a step at 256 rows.
            req.output_token_ids.append(token)
            req.all_token_ids.append(token)
            if screen_rows and may_stop(req, token) and check_stop(req, token, max_len):
                any_finished = True
                self._release(req)
        screen.tokens_left -= 1      # each row got one token; the next step reuses the screen only if so
        self._screen = screen
        advanced = [r for r in reqs if r not in skipped] if skipped else list(reqs)
        if any_finished:
            self.running = [r for r in self.running if r.status is RUNNING]
            self._decoding = _Decoding([r for r in advanced if r.status is RUNNING],
                                       [r for r in full if r.status is RUNNING])
        else:
            self._decoding = _Decoding(list(advanced), full)
        return advanced

    @staticmethod
    def _check_runner_output(out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """The runner output must hold one token per sampled row, in row order (else it is a runner bug)."""
        ids, tokens = runner_out.req_ids, runner_out.sampled_token_ids
        if len(ids) != len(tokens):
            raise ValueError(f"runner output has {len(ids)} req_ids but {len(tokens)} sampled tokens")
        expected = out.sampled_req_ids()
        if ids == expected:
            return
        if len(ids) != len(expected):
            raise ValueError(f"runner output has {len(ids)} sampled rows, the schedule asked for {len(expected)}")
        j = next(j for j, (a, b) in enumerate(zip(ids, expected)) if a != b)
        raise ValueError(f"runner output row {j} does not match scheduled request {expected[j]!r}")

    def apply_sampled_tokens(self, reqs: list[Request], out_indices: list[int], tokens: list[int]) -> None:
        """apply_sampled_token() over a step's rows. A row still running that its token cannot end (may_stop)
        only has the token written in, without the call."""
        apply = self.apply_sampled_token
        for req, out_index, token in zip(reqs, out_indices, tokens):
            if req.status is RUNNING and not may_stop(req, token):
                req.output_token_ids[out_index] = token
                req.all_token_ids[req.num_prompt_tokens + out_index] = token
            else:
                apply(req, out_index, token)

    def apply_sampled_token(self, req: Request, out_index: int, token: int) -> bool:
        """Async scheduling: update() appended a placeholder for a token still on the GPU; it is now known.

        Writes it in, then runs the stop checks that depend on its value (EOS, stop ids; the length checks
        already ran in update()). Returns True if the request finished here. Works for a request preempted
        since (it is waiting then) and is a no-op check for one that already finished.
        """
        req.output_token_ids[out_index] = token
        req.all_token_ids[req.num_prompt_tokens + out_index] = token
        if req.status is RequestStatus.FINISHED_LENGTH:
            # update() ended it on length at this very token; as in check_stop, a stop by value wins.
            value_stop(req, token)
            return False
        if req.is_finished:
            return False
        if not may_stop(req, token):
            return False     # the screen of update(): neither a stop id nor the length limit
        was_waiting = req.status is WAITING
        # NOTE: a request has at most one placeholder (the step in flight), so this token is its last output
        # and check_stop sees exactly what a synchronous update() would have seen.
        if not check_stop(req, token, self.max_model_len):
            return False
        del self.requests[req.request_id]
        if was_waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._forget(req)
        return True

    def _release(self, req: Request) -> None:
        del self.requests[req.request_id]
        self._forget(req)

    def _forget(self, req: Request) -> None:
        """A finished request leaves the KV cache, and the runner hears of it with the next step."""
        self.kv.free(req)
        if req.num_sent_blocks >= 0:
            self._finished_ids.append(req.request_id)

    # ---- invariants ---------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless queues, statuses and the KV cache agree (run after steps in tests)."""
        waiting, running = list(self.waiting), self.running
        ids = [r.request_id for r in waiting] + [r.request_id for r in running]
        if len(ids) != len(set(ids)) or set(ids) != set(self.requests):
            raise AssertionError(f"queues hold {sorted(ids)[:8]}..., request map holds {sorted(self.requests)[:8]}...")
        for r in waiting:
            if r.status is not WAITING or r.num_computed_tokens or r.block_ids:
                raise AssertionError(f"waiting request {r.request_id} has status {r.status.value}, "
                                     f"{r.num_computed_tokens} computed tokens, {len(r.block_ids)} blocks")
        for r in running:
            if r.status is not RUNNING or r.num_computed_tokens >= r.num_tokens:
                raise AssertionError(f"running request {r.request_id}: status {r.status.value}, "
                                     f"{r.num_computed_tokens}/{r.num_tokens} tokens computed")
        if len(running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(running)} running > max_num_seqs={self.config.max_num_seqs}")
        self.kv.check_integrity(self.requests.values())
