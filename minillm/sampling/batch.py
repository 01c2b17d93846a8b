"""Per-step sampling tensors, built once per step on the host from the rows that need a token.

Everything a batch does not need is left as None, so the sampler skips its pass over the vocabulary:
an all-greedy batch without penalties or min_tokens is a single argmax; no penalty tensors unless some row
uses a penalty; no top-k/top-p tensors unless a sampling row uses them. The per-row scalars travel in one
packed host->device copy. Host work is a join of each request's pre-packed float32 row (Request.sampling_row)
plus numpy; per-row Python loops run only over the rows that need them (min_tokens, seeds, logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from minillm.contract import SamplingRow as Request   # a row's request, as the sampler reads it
from minillm.device import to_device
from minillm.sampling_params import ROW_FIELDS
from minillm.sampling.penalties import PenaltyTensors, pad_token_arrays, token_history

_MASK64 = (1 << 64) - 1
_GREEDY_BELOW = 1e-5

# Rows of the packed [len(_FIELDS), N] float32 parameter matrix: Request.sampling_row, transposed. The last
# three are host-only flags (min_tokens, seeded, wants logprobs) that say which per-row loops are needed.
_FIELDS = ROW_FIELDS
_T, _P, _MINP, _K, _PRES, _FREQ, _REP, _MINTOK, _SEEDED, _LOGPROBS = range(len(_FIELDS))
_DEVICE_FIELDS = _REP + 1   # rows [0, _DEVICE_FIELDS) are shipped to the device


@dataclass
class SeededRows:
    """The sampling rows with a per-request seed: int64 [3, M] = (row, seed as 64 bits, index of the output token
    sampled when the batch was built), on the host (args) and on the batch's device (args_dev, one copy); the
    token sampled now is output args[2] + offset. Their noise is keyed by (seed, output index) alone
    (minillm/ops/sampling_ops.py: seeded_exponential_), never by the row or the batch, so a seeded request draws
    the same noise alone, in any batch, and after preemption + recompute."""
    args: np.ndarray
    args_dev: torch.Tensor
    offset: int = 0

    def advance(self, requests: Sequence[Request], seq_lens) -> bool:
        """For a batch handed back for another step: move offset to where every row's output index now is, if
        they all moved by the same count (one per step in a run of decodes); False if not (then rebuild)."""
        now = np.array([_outputs_before(requests[i], i, seq_lens) for i in self.args[0].tolist()], dtype=np.int64)
        delta = now - self.args[2]
        if delta.size == 0 or (delta != delta[0]).any() or delta[0] < 0:
            return False
        self.offset = int(delta[0])
        return True


@dataclass
class SamplingBatch:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy_mask: torch.Tensor | None      # bool [N]; None when no row, or every row, is greedy
    temperature: torch.Tensor | None      # [N, 1]; greedy rows hold 1.0; None when every sampling row has T=1
    top_k: torch.Tensor | None            # int64 [N]; vocab_size = disabled
    max_top_k: int                        # host copy of the largest enabled top_k (0 = none)
    top_p: torch.Tensor | None            # [N]; 1.0 = disabled
    min_p: torch.Tensor | None            # [N]; 0.0 = disabled
    penalties: PenaltyTensors | None
    banned_rows: torch.Tensor | None      # int64 [M]: (row, token) pairs masked to -inf (min_tokens)
    banned_cols: torch.Tensor | None
    seeded: SeededRows | None             # the seeded sampling rows; None when there are none
    any_unseeded: bool                    # some sampling row draws from the shared generator
    logprobs: list[int | None] | None     # per-row top-N request; None when no row asked
    _inv_t: torch.Tensor | None = field(default=None, repr=False, compare=False)   # inverse_temperature()
    _unit_inv_t: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def inverse_temperature(self, device: torch.device) -> torch.Tensor:
        """float32 [N] on `device`: 1 / T per row, 0 on greedy rows (the one-pass kernel's input). Made once per
        batch: a batch handed back by SamplingBatchCache then costs no kernel launch for it."""
        if self._inv_t is None:
            n = self.num_rows
            if self.all_greedy:
                inv_t = torch.zeros(n, device=device)
            else:
                inv_t = 1.0 / self.temperature.view(n) if self.temperature is not None else torch.ones(n, device=device)
                if self.greedy_mask is not None:
                    inv_t = inv_t.masked_fill(self.greedy_mask, 0.0)
            self._inv_t = inv_t.float().contiguous()
        return self._inv_t

    @property
    def truncates(self) -> bool:
        """Whether some row uses top-k, top-p or min-p."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    def unit_inverse_temperature(self, device: torch.device) -> torch.Tensor:
        """float32 [N] on `device`: 1 on sampling rows, 0 on greedy rows; the one-pass kernel's input for logits
        already divided by their temperature (truncated batches). Made once per batch."""
        if self._unit_inv_t is None:
            ones = torch.ones(self.num_rows, device=device)
            self._unit_inv_t = ones.masked_fill(self.greedy_mask, 0.0) if self.greedy_mask is not None else ones
        return self._unit_inv_t

    @property
    def is_static(self) -> bool:
        """Whether the same requests give this very batch next step, seeded rows' offset aside (SeededRows.advance):
        true unless a row reads its token history (penalties) or output count (a min_tokens ban; once lifted, a
        ban never returns)."""
        return self.penalties is None and self.banned_rows is None

    @classmethod
    def build(cls, requests: Sequence[Request], device: torch.device | str, vocab_size: int,
              seq_lens: Sequence[int] | None = None) -> "SamplingBatch":
        """seq_lens: each row's context length including this step's tokens, so the token sampled now is output
        number seq_len - num_prompt_tokens (what min_tokens and per-token seeds count); None = the end of each
        request's token list (a request whose earlier tokens are all known on the host)."""
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        device = torch.device(device)
        params = _host_params(requests, vocab_size)
        # Temperatures this small overflow logits / T; like vLLM, treat them as greedy.
        greedy = params[_T] < _GREEDY_BELOW
        sampling = ~greedy
        all_greedy = not sampling.any()
        # Greedy rows take the argmax before temperature and truncation: neutral values keep them out of both.
        params[_T, greedy] = 1.0
        params[_P, greedy] = 1.0
        params[_MINP, greedy] = 0.0
        params[_K, greedy] = vocab_size
        need = _needs(params, all_greedy, vocab_size)
        dev = to_device(params[:_DEVICE_FIELDS], device) if any(need.values()) else None  # one copy; views
        banned_rows, banned_cols = _min_tokens_mask(requests, seq_lens, params[_MINTOK], vocab_size, device)
        mixed = not all_greedy and bool(greedy.any())
        return cls(
            num_rows=len(requests),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy_mask=to_device(greedy, device) if mixed else None,
            temperature=dev[_T].unsqueeze(1) if need["temperature"] else None,
            top_k=dev[_K].long() if need["top_k"] else None,
            max_top_k=int(params[_K][params[_K] < vocab_size].max()) if need["top_k"] else 0,
            top_p=dev[_P] if need["top_p"] else None,
            min_p=dev[_MINP] if need["min_p"] else None,
            penalties=_penalties(requests, dev, need, vocab_size, device),
            banned_rows=banned_rows,
            banned_cols=banned_cols,
            seeded=_seeded(requests, seq_lens, sampling & (params[_SEEDED] > 0), device),
            any_unseeded=bool((sampling & (params[_SEEDED] == 0)).any()),
            logprobs=_logprobs(requests) if params[_LOGPROBS].any() else None,
        )


class SamplingBatchCache:
    """Hands back the last step's SamplingBatch while the same requests sample and nothing in it moves with the
    step but seeded rows' output indices (their offset moves instead): at 256 decodes, consecutive steps usually
    sample the very same requests, and rebuilding an identical batch would cost a quarter of the step's host
    budget."""

    def __init__(self, device: torch.device | str, vocab_size: int) -> None:
        self.device, self.vocab_size = torch.device(device), vocab_size
        self._requests: list[Request] = []
        self._batch: SamplingBatch | None = None

    def get(self, requests: Sequence[Request], seq_lens: Sequence[int] | None = None) -> SamplingBatch:
        # NOTE: list == compares element identity in C; the sampler never writes into a batch's tensors.
        batch = self._batch
        if batch is None or not batch.is_static or requests != self._requests or \
                (batch.seeded is not None and not batch.seeded.advance(requests, seq_lens)):
            batch = self._batch = SamplingBatch.build(requests, self.device, self.vocab_size, seq_lens)
            self._requests = list(requests)
        return batch


def _needs(params: np.ndarray, all_greedy: bool, vocab_size: int) -> dict[str, bool]:
    """Which per-row tensors this batch needs (greedy rows already hold neutral values)."""
    return {
        "temperature": not all_greedy and bool((params[_T] != 1.0).any()),
        "top_k": bool((params[_K] < vocab_size).any()),
        "top_p": bool((params[_P] < 1.0).any()),
        "min_p": bool((params[_MINP] > 0.0).any()),
        "presence": bool((params[_PRES] != 0.0).any()),
        "frequency": bool((params[_FREQ] != 0.0).any()),
        "repetition": bool((params[_REP] != 1.0).any()),
    }


def _host_params(requests: Sequence[Request], vocab_size: int) -> np.ndarray:
    """[len(_FIELDS), N] float32 matrix of the per-row scalars (top_k <= 0 or >= V becomes V = disabled)."""
    packed = b"".join([r.sampling_row for r in requests])
    arr = np.frombuffer(packed, dtype=np.float32).reshape(len(requests), len(_FIELDS))
    params = arr.T.copy()   # writable, row-major [fields, N]
    k = params[_K]
    params[_K] = np.where((k > 0) & (k < vocab_size), k, vocab_size)
    return params


def _penalties(requests: Sequence[Request], dev: torch.Tensor | None, need: dict, vocab_size: int,
               device: torch.device) -> PenaltyTensors | None:
    use_rep, use_out = need["repetition"], need["presence"] or need["frequency"]
    if not (use_rep or use_out):
        return None

    def ids(select) -> torch.Tensor:
        # Only rows that use the penalty ship their tokens; the others are pure padding.
        return to_device(pad_token_arrays([select(r) for r in requests], vocab_size), device)

    def outputs(r: Request) -> np.ndarray | None:
        sp = r.sampling_params
        return token_history(r)[r.num_prompt_tokens:] if sp.presence_penalty or sp.frequency_penalty else None

    def seen(r: Request) -> np.ndarray | None:
        return token_history(r) if r.sampling_params.repetition_penalty != 1.0 else None

    return PenaltyTensors(
        presence=dev[_PRES].unsqueeze(1) if need["presence"] else None,
        frequency=dev[_FREQ].unsqueeze(1) if need["frequency"] else None,
        repetition=dev[_REP].unsqueeze(1) if use_rep else None,
        output_ids=ids(outputs) if use_out else None,
        seen_ids=ids(seen) if use_rep else None,
    )


def _outputs_before(r: Request, i: int, seq_lens: Sequence[int] | None) -> int:
    """How many output tokens row i's request has before the one sampled now."""
    return r.num_output_tokens if seq_lens is None else int(seq_lens[i]) - r.num_prompt_tokens


def _min_tokens_mask(requests: Sequence[Request], seq_lens, min_tokens: np.ndarray, vocab_size: int,
                     device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row, token) pairs to forbid: EOS (unless ignore_eos) and stop_token_ids while fewer than min_tokens
    outputs exist (rows with a grammar excepted). Ids outside the logits' width cannot be sampled anyway and are
    dropped."""
    rows: list[int] = []
    cols: list[int] = []
    for i in np.flatnonzero(min_tokens > 0).tolist():
        r = requests[i]
        sp = r.sampling_params
        if sp.structured is not None or _outputs_before(r, i, seq_lens) >= sp.min_tokens:
            continue   # a constrained row's ban is part of its grammar mask (minillm/structured/rows.py)
        banned = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            banned |= r.eos_token_ids
        for t in banned:
            if 0 <= t < vocab_size:
                rows.append(i)
                cols.append(t)
    if not rows:
        return None, None
    return (to_device(np.array(rows, dtype=np.int64), device), to_device(np.array(cols, dtype=np.int64), device))


def _seeded(requests: Sequence[Request], seq_lens, seeded_sampling: np.ndarray,
            device: torch.device) -> SeededRows | None:
    rows = np.flatnonzero(seeded_sampling)
    if rows.size == 0:
        return None
    args = np.empty((3, rows.size), dtype=np.int64)
    args[0] = rows
    idx = rows.tolist()
    args[1] = np.array([requests[i].sampling_params.seed & _MASK64 for i in idx], dtype=np.uint64).view(np.int64)
    args[2] = [_outputs_before(requests[i], i, seq_lens) for i in idx]
    return SeededRows(args, to_device(args, device))


def _logprobs(requests: Sequence[Request]) -> list[int | None] | None:
    lp = [r.sampling_params.logprobs for r in requests]
    return lp if any(x is not None for x in lp) else None
