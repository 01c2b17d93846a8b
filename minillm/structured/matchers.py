"""The matcher side of structured outputs: one xgrammar matcher per live constrained request, brought to a step's
outputs and asked for its bitmask row. GrammarRows (rows.py) runs it in the engine's process, or MaskWorker
(mask_worker.py) in a process of its own; either way a step arrives as a list of RowWork.

A matcher always stands at a known point of its request's output: it has accepted the first `accepted` output
tokens of `history` (the output tokens it has been sent). A RowWork says how many outputs precede the token
sampled now (`before`) and brings `history` up to date first (`start`, `tokens`: history[start:] becomes
tokens). The matcher then accepts what it has not seen or rolls back what the engine no longer holds.

A steady decode step (the same rows as the step before, each one token further) needs no RowWork from the
engine: fill_next builds it from the last fill's and the tokens that step sampled (GrammarRows.masks says when).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from minillm.config import StructuredConfig


@dataclass(eq=False)
class GrammarState:
    matcher: object                 # xgrammar.GrammarMatcher
    accepted: int = 0               # output tokens the matcher has accepted
    failed: bool = False            # a token the grammar refused (cannot happen under the mask): left unmasked
    banned: tuple[int, ...] = ()    # what min_tokens bans: EOS (unless ignore_eos) and the stop token ids
    history: list[int] = field(default_factory=list)   # the output tokens sent so far
    min_tokens: int = 0             # the request's min_tokens: fill_next bans below it, as the engine does


class RowWork(NamedTuple):
    """One constrained row's work for a step, the fields in this order. The engine builds plain tuples in this
    layout (GrammarRows._work): a NamedTuple pickles through a Python call per instance, about 100 us per step
    at 64 rows on the engine's thread, against 16 us for plain tuples; the matchers only unpack them."""
    row: int                        # the row of the step's bitmask
    req_id: str
    start: int                      # history[start:] is replaced by tokens
    tokens: tuple[int, ...]
    before: int                     # outputs preceding the token sampled now
    ban: bool                       # min_tokens is not reached: clear the banned tokens (unless nothing else is left)
    slot: int = -1                  # the row among the step's sampled rows (its token's index): fill_next reads it


class Matchers:
    def __init__(self, model_dir, vocab_size: int, cfg: StructuredConfig):
        self.model_dir, self.vocab_size, self.cfg = model_dir, vocab_size, cfg
        self.states: dict[str, GrammarState] = {}
        self._batch = None
        self.last: list[tuple] = []     # the last fill's RowWork (fill_next follows on from it)

    def open(self, req_id: str, spec, banned: tuple[int, ...], eos_ids: tuple[int, ...], min_tokens: int = 0) -> None:
        import xgrammar as xgr
        from minillm.structured.compiler import grammar_service

        compiled = grammar_service(self.model_dir, self.vocab_size, self.cfg).compiled(spec)
        self.states[req_id] = GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=list(eos_ids) or None),
                                           banned=banned, min_tokens=min_tokens)

    def drop(self, req_ids) -> None:
        for rid in req_ids:
            self.states.pop(rid, None)

    def fill(self, work: list[tuple], bitmask: np.ndarray) -> None:
        """Bring each row's matcher to its outputs and write its bitmask row (int32 [rows, words]); a row whose
        matcher refused a token or has terminated is left all ones (unconstrained: its token is dropped)."""
        self.last = work
        if not work:
            return
        states = [self.states[w[1]] for w in work]
        self._advance_all(work, states)
        matchers, rows, groups = [], [], {}
        for (row, _, _, _, _, ban, *_), st in zip(work, states):
            if st.failed or st.matcher.is_terminated():
                bitmask[row] = -1
                continue
            matchers.append(st.matcher)
            rows.append(row)
            if ban and st.banned:
                groups.setdefault(st.banned, []).append(row)
        if matchers:
            self._fill(matchers, bitmask, rows)
        words = bitmask.view(np.uint32)
        for banned, ban_rows in groups.items():
            _ban(words, np.asarray(ban_rows), np.asarray(banned, dtype=np.int64))

    def _advance_all(self, work: list[tuple], states: list[GrammarState]) -> None:
        """The common case, one new token per row, goes to xgrammar in one batched call; rollbacks and catch-ups
        (preemption, a resync) go row by row."""
        one, tokens = [], []
        for (_, _, start, new, before, *_), st in zip(work, states):
            history = st.history
            if start == len(history) and len(new) == 1:   # the common case: one more output
                history.append(new[0])
            else:
                del history[start:]
                history.extend(new)
            if before == st.accepted + 1 and not st.failed:
                one.append(st)
                tokens.append(history[st.accepted])
            else:
                _advance(st, before)
        if one:
            import xgrammar as xgr
            for st, ok in zip(one, xgr.BatchGrammarMatcher.batch_accept_token([st.matcher for st in one], tokens)):
                st.failed = not ok
                st.accepted += 1

    def fill_next(self, tokens: np.ndarray, bitmask: np.ndarray) -> None:
        """fill() for the step after the last fill, with the same rows each one output further: `tokens` (int64,
        by sampled row) are what that step sampled, each row's new output."""
        states = self.states
        work = []
        for row, rid, _, _, before, _, slot in self.last:
            st = states.get(rid)
            if st is None:
                raise RuntimeError(f"a steady fill follows a row whose request {rid!r} was dropped")
            work.append((row, rid, before, (int(tokens[slot]),), before + 1, before + 1 < st.min_tokens, slot))
        self.fill(work, bitmask)

    def _fill(self, matchers, bitmask: np.ndarray, rows: list[int]) -> None:
        view = torch.from_numpy(bitmask)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(view, rows[0])
            return
        if self._batch is None:
            import xgrammar as xgr
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.cfg.mask_threads)
        self._batch.batch_fill_next_token_bitmask(matchers, view, indices=rows)


_BARRIER = threading.Lock()


def memory_barrier() -> None:
    """A full memory barrier on every CPU (taking a lock is one): orders this thread's stores before its later
    loads and stores, as seen by another process or a CUDA stream reading the same memory."""
    with _BARRIER:
        pass


def publish_flag(flags: np.ndarray, turn: int, value: int) -> None:
    """Store a fill's flag (its sequence number, negative if it failed) once its rows are written: whoever sees
    the flag (a CUDA stream, the engine) also sees the rows."""
    memory_barrier()
    flags[turn] = value


def _advance(st: GrammarState, before: int) -> None:
    if before < st.accepted:
        st.matcher.rollback(st.accepted - before)
        st.accepted = before
    while st.accepted < before and not st.failed:
        st.failed = not st.matcher.accept_token(st.history[st.accepted])
        st.accepted += 1


def _ban(words: np.ndarray, rows: np.ndarray, banned: np.ndarray) -> None:
    """Clear the banned tokens' bits in `rows` of the uint32 bitmask `words`, except in a row left with none.
    Only the banned tokens' words are read, and only rows that allowed one of them are checked for emptiness
    (mostly none: the grammar allows EOS only where it may end), so a step costs a small gather, not a pass."""
    cols = np.unique(banned >> 5)
    keep = np.full(len(cols), 0xFFFFFFFF, dtype=np.uint32)
    bits = np.left_shift(np.uint32(1), (banned & 31).astype(np.uint32))
    np.bitwise_and.at(keep, np.searchsorted(cols, banned >> 5), ~bits)
    saved = words[np.ix_(rows, cols)]
    cleared = saved & keep
    hit = np.flatnonzero((cleared != saved).any(axis=1))
    if not len(hit):
        return
    hit_rows = rows[hit]
    words[np.ix_(hit_rows, cols)] = cleared[hit]
    empty = ~words[hit_rows].any(axis=1)
    if empty.any():
        words[np.ix_(hit_rows[empty], cols)] = saved[hit[empty]]
