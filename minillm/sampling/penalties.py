"""Presence / frequency / repetition penalties on a batch of logits rows.

Semantics:
- presence and frequency (OpenAI): over the request's *output* tokens only,
  ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``.
- repetition (HF transformers): over prompt + output tokens, a seen token's logit is divided by the penalty
  when positive and multiplied by it when negative, so a penalty > 1 always makes the token less likely.

The token lists travel to the device as padded [N, L] int64 matrices whose padding is the id ``vocab_size``;
scattering into a [N, V + 1] buffer lets the padding land in a throw-away column instead of needing a mask.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from minillm.contract import SamplingRow as Request   # a row's request, as the sampler reads it

@dataclass
class PenaltyTensors:
    """Per-row penalty values ([N, 1] float32 views) and the token matrices they apply to.

    A field is None when no row of the batch uses that penalty, so its pass over the vocabulary is skipped.
    """
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_ids: torch.Tensor | None     # [N, L] output tokens, padded with vocab_size
    seen_ids: torch.Tensor | None       # [N, L] prompt + output tokens, padded with vocab_size


class _History:
    """A request's token ids (prompt + output) as a growable numpy buffer."""
    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int64)
        self.n = 0


# NOTE: converting a request's whole token list to numpy every step costs ~100 ns a token (tens of ms at 256
# rows x 1k tokens), so each penalised request keeps a numpy copy that only appends the tokens added since
# the last step. Keyed weakly by the Request object: the entry disappears with the request.
_HISTORIES: "weakref.WeakKeyDictionary[Request, _History]" = weakref.WeakKeyDictionary()


def token_history(request: Request) -> np.ndarray:
    """request.all_token_ids as an int64 array, in O(new tokens) per call."""
    h = _HISTORIES.get(request)
    ids = request.all_token_ids
    if h is None or h.n > len(ids):  # token lists only grow; anything else means start over
        h = _HISTORIES[request] = _History()
    if h.n < len(ids):
        new = np.asarray(ids[h.n:], dtype=np.int64)
        if h.n + len(new) > len(h.buf):
            grown = np.empty(max(2 * len(h.buf), h.n + len(new), 64), dtype=np.int64)
            grown[: h.n] = h.buf[: h.n]
            h.buf = grown
        h.buf[h.n: h.n + len(new)] = new
        h.n += len(new)
    return h.buf[: h.n]


def pad_token_arrays(arrays: Sequence[np.ndarray | None], pad: int) -> np.ndarray:
    """Stack ragged token arrays into an int64 matrix padded with ``pad`` (None rows are all padding)."""
    width = max((len(x) for x in arrays if x is not None), default=0)
    out = np.full((len(arrays), max(width, 1)), pad, dtype=np.int64)
    for i, ids in enumerate(arrays):
        if ids is not None:
            out[i, : len(ids)] = ids
    return out


def _counts(ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, V] occurrence counts of each token id per row (padding dropped)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=dtype, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> None:
    """Apply the batch's penalties to ``logits`` [N, V] in place. Rows whose values are neutral
    (presence 0, frequency 0, repetition 1) come out unchanged."""
    vocab = logits.shape[1]
    if pen.repetition is not None:
        seen = _counts(pen.seen_ids, vocab, logits.dtype) > 0
        scaled = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
        logits.copy_(torch.where(seen, scaled, logits))
    if pen.frequency is not None or pen.presence is not None:
        counts = _counts(pen.output_ids, vocab, logits.dtype)
        if pen.frequency is not None:
            logits.sub_(counts * pen.frequency)
        if pen.presence is not None:
            logits.sub_((counts > 0).to(logits.dtype) * pen.presence)
