"""The runner's grammar state: one xgrammar matcher per live constrained request, and each step's bitmask.

A matcher always stands at a known point of its request's output: it has accepted the first `accepted` output
tokens. Before a step samples a constrained row, the matcher is brought to exactly the outputs that precede the
token sampled now (the row's position says how many), accepting what it has not seen or rolling back what the
engine no longer holds. Recomputation after preemption and prefix hits change no output token, so they leave
the matcher where it is.

Async scheduling: step N+1 is launched while step N's tokens are still on the device. The forward pass of N+1 is
queued first (it takes N's tokens from the device); only before N+1's sampler does the host wait for N's tokens
(which the GPU finished before N+1's forward began), advance the matchers and fill the mask. The GPU runs N+1's
forward meanwhile, so the wait costs host time, not GPU time. Steps without a constrained row never wait.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minillm.config import StructuredConfig
from minillm.sampling.grammar_mask import GrammarMask


@dataclass(eq=False)
class GrammarState:
    matcher: object                 # xgrammar.GrammarMatcher
    accepted: int = 0               # output tokens the matcher has accepted
    failed: bool = False            # a token the grammar refused (cannot happen under the mask): left unmasked
    banned: tuple[int, ...] = ()    # what min_tokens bans: EOS (unless ignore_eos) and the stop token ids


class GrammarRows:
    def __init__(self, model_dir, vocab_size: int, cfg: StructuredConfig, device: torch.device,
                 max_rows: int):
        self.model_dir, self.vocab_size, self.cfg, self.device = model_dir, vocab_size, cfg, device
        self.max_rows = max_rows
        self.states: dict[str, GrammarState] = {}
        self._host: list[torch.Tensor] = []    # two bitmask buffers used in turn (a copy may be in flight)
        self._index: list[torch.Tensor] = []   # and the constrained rows' indices
        self._turn = 0
        self._batch = None

    def update(self, so) -> None:
        """Follow the step's plain-data changes: a matcher for each new constrained request, none for ended ones."""
        for rid in so.finished_ids:
            self.states.pop(rid, None)
        for new in so.new_requests:
            spec = new.sampling_params.structured
            if spec is not None:
                self.states[new.req_id] = self._new_state(new.sampling_params, new.eos_token_ids)

    def _new_state(self, sp, eos_ids) -> GrammarState:
        import xgrammar as xgr
        from minillm.structured.compiler import grammar_service

        compiled = grammar_service(self.model_dir, self.vocab_size, self.cfg).compiled(sp.structured)
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(eos_ids) or None),
                            banned=tuple(sorted(t for t in banned if 0 <= t < self.vocab_size)))

    def masks(self, sampled, seq_lens, prev) -> GrammarMask | None:
        """The bitmask of this step's constrained rows (None when there is none: the sampler skips masking).
        sampled: the rows' request states; seq_lens: each row's length with this step's tokens; prev: the
        launched step whose tokens have not reached the host yet (async scheduling), or None."""
        if not self.states:
            return None
        rows = [i for i, r in enumerate(sampled) if r.request_id in self.states]
        if not rows:
            return None
        outputs = [int(seq_lens[i]) - sampled[i].num_prompt_tokens for i in rows]
        states = [self.states[sampled[i].request_id] for i in rows]
        self._advance_all([sampled[i] for i in rows], states, outputs, prev)
        bitmask = self._host_buffer(len(rows))
        live_at = [j for j, st in enumerate(states) if not (st.failed or st.matcher.is_terminated())]
        if len(live_at) < len(rows):
            bitmask.fill_(-1)              # a dropped token (its request has ended) or an unconstrained one
        if live_at:
            self._fill([states[j].matcher for j in live_at], bitmask, live_at)
            self._min_tokens(bitmask, [sampled[i].sampling_params.min_tokens for i in rows], states, outputs,
                             live_at)
        if len(rows) == len(sampled):
            return GrammarMask(self._to_device(bitmask), None)
        index = self._index[self._turn][:len(rows)]
        index.copy_(torch.as_tensor(rows, dtype=torch.int64))
        return GrammarMask(self._to_device(bitmask), self._to_device(index))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # Pinned buffers used in turn: step N's copy is done before N + 2 refills its buffer (the engine has
        # resolved step N by then, and its event follows the copy).
        return host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host.clone()

    def _advance_all(self, reqs, states, outputs, prev) -> None:
        """Bring every matcher to the outputs before this step's token. The common case, one new token per row,
        goes to xgrammar in one batched call; rollbacks and catch-ups (preemption, a resync) go row by row."""
        pending = None
        if any(n > r.num_output_tokens for r, n in zip(reqs, outputs)):
            pending = _pending_tokens(prev)
        one, tokens = [], []
        for r, st, n in zip(reqs, states, outputs):
            if n == st.accepted + 1 and not st.failed:
                one.append(st)
                tokens.append(_output_token(r, st.accepted, pending))
            else:
                self._advance(st, r, n, pending)
        if one:
            import xgrammar as xgr
            for st, ok in zip(one, xgr.BatchGrammarMatcher.batch_accept_token([st.matcher for st in one], tokens)):
                st.failed = not ok
                st.accepted += 1

    def _advance(self, st: GrammarState, r, before: int, pending: dict | None) -> None:
        if before < st.accepted:
            st.matcher.rollback(st.accepted - before)
            st.accepted = before
        while st.accepted < before and not st.failed:
            st.failed = not st.matcher.accept_token(_output_token(r, st.accepted, pending))
            st.accepted += 1

    def _fill(self, matchers, bitmask, at) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, at[0])
            return
        if self._batch is None:
            import xgrammar as xgr
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.cfg.mask_threads)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=at)

    def _min_tokens(self, bitmask: torch.Tensor, min_tokens, states, outputs, live_at) -> None:
        """min_tokens bans EOS and stop token ids, unless the grammar allows nothing else (it is complete):
        then EOS stays allowed, so the ban never fights the grammar. Rows sharing a banned set are cleared with a
        few numpy operations on the host buffer, whatever their number."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for j in live_at:
            if outputs[j] < min_tokens[j] and states[j].banned:
                groups.setdefault(states[j].banned, []).append(j)
        words = bitmask.numpy().view(np.uint32)
        for banned, js in groups.items():
            _ban(words, np.asarray(js), np.asarray(banned, dtype=np.int64))

    def _host_buffer(self, n: int) -> torch.Tensor:
        if not self._host:
            words = (self.vocab_size + 31) // 32
            pin = self.device.type == "cuda"
            self._host = [torch.empty(self.max_rows, words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            self._index = [torch.empty(self.max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn ^= 1
        return self._host[self._turn][:n]


def _ban(words: np.ndarray, rows: np.ndarray, banned: np.ndarray) -> None:
    """Clear the banned tokens' bits in `rows` (ascending) of the uint32 bitmask `words`, except in a row left
    with none. Rows are usually one contiguous run (all the step's constrained rows): then it works on a view."""
    cols = np.unique(banned >> 5)
    keep = np.full(len(cols), 0xFFFFFFFF, dtype=np.uint32)
    bits = np.left_shift(np.uint32(1), (banned & 31).astype(np.uint32))
    np.bitwise_and.at(keep, np.searchsorted(cols, banned >> 5), ~bits)
    contiguous = rows[-1] - rows[0] + 1 == len(rows)
    block = words[rows[0]:rows[-1] + 1] if contiguous else words[rows]
    saved = block[:, cols]
    block[:, cols] = saved & keep
    empty = ~block.any(axis=1)
    if empty.any():
        block[np.ix_(empty, cols)] = saved[empty]
    if not contiguous:
        words[rows] = block


def _output_token(r, k: int, pending: dict | None) -> int:
    """Output token k of request state r, from the host copy or, for the step still in flight, `pending`."""
    i = r.num_prompt_tokens + k
    ids = r.all_token_ids
    return ids[i] if i < len(ids) else pending[r.request_id]


def _pending_tokens(prev) -> dict[str, int]:
    """The tokens of the launched step `prev`, by request id, once its copy to the host is done."""
    if prev is None or prev.host_ids is None:
        raise RuntimeError("a constrained row is missing its previous token, and no step is in flight")
    if prev.done is not None:
        prev.done.synchronize()
    return dict(zip(prev.req_ids, prev.host_ids.tolist()))
