"""Token sampler: greedy argmax or exponential-race sampling with top-k / top-p / min-p, penalties,
min_tokens, per-request seeds and logprobs.

Logits arrive as the lm_head produced them (bf16 / fp16 / fp32). The one-pass CUDA kernel reads half-precision
logits directly when it covers the whole batch unchanged (plain temperature sampling, no penalties or bans);
every other path first widens them to float32 (exact), and then works on that float32 copy, or on fp32 input
itself, in place. Either way a row gets the same token as from its float32 logits.

Order of operations on a batch of float32 logits [N, V] (modified in place):
  1. penalties (repetition, then frequency/presence), the min_tokens mask and the grammar bitmask of
     constrained rows (sampling/grammar_mask.py): greedy rows see them too;
  2. greedy rows: argmax (an all-greedy batch stops here; with the CUDA kernels and no logprobs, the one-pass
     kernel takes it, every row at inverse temperature 0, which is the same argmax);
  3. temperature;
  4. logprobs, when asked: log-softmax of the logits *after penalties and temperature, before truncation*
     (so top-N alternatives are real numbers even when top-k/top-p would have cut them);
  5. truncation: one threshold per row from top-k, then top-p on the renormalised top-k distribution
     (the token that crosses p is kept), then min-p; everything below the threshold becomes -inf (with the
     CUDA kernels, the threshold is one radix-select kernel instead of a sort: sampling_ops.truncation_threshold);
  6. exponential race: token = argmax(probs / E), E ~ Exp(1), which draws exactly from probs (Gumbel-max);
     unseeded rows draw E from the sampler's generator, seeded rows from a counter-based generator keyed by
     (their seed, their output index), all seeded rows of a batch in one op.
With the CUDA kernels, a truncated batch without seeds or logprobs runs 3, 5 and 6 as the fp32 copy, the
division, the threshold kernel and the one-pass race, which skips what the threshold masks (its noise is the
kernel's own, keyed by the sampler's seed and step); untruncated, as the race alone.

No host syncs: every decision that depends on the batch composition was made on the host by
SamplingBatch.build. Only logprobs need one transfer (to build Python objects), done once for the batch.

Raw logits that hold NaN or inf (a broken checkpoint, an overflow in half precision) make every token
meaningless: NonFiniteWatch says so once on stderr, reading each step's flag one step later so as to add no sync.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from minillm.contract import TokenLogprobs
from minillm.sampling.batch import SamplingBatch
from minillm.sampling.grammar_mask import GrammarMask, apply_grammar_mask
from minillm.ops.sampling_ops import LOGIT_DTYPES, seeded_exponential_, truncation_threshold
from minillm.sampling.penalties import apply_penalties

# Exp(1) draws can be exactly 0 (the uniform hit its endpoint); 0 would turn masked tokens into 0/0 = NaN,
# which argmax prefers. Clamping to the smallest normal float changes nothing else.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerResult:
    token_ids: torch.Tensor                         # int64 [N] on the logits' device
    logprobs: list[TokenLogprobs | None] | None     # per row; None when no row asked for logprobs


class Sampler:
    def __init__(self, seed: int = 0, *, cuda: bool = False) -> None:
        """cuda: the one-pass sampling kernel may run (the engine's execution plan)."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self.cuda = cuda
        # Per device: the generator of the unseeded rows' noise (seeded rows' noise needs none).
        self._generators: dict[torch.device, torch.Generator] = {}
        self._fused_steps = 0
        self.nonfinite = NonFiniteWatch()

    def warm_up(self, logits: torch.Tensor) -> None:
        """Run, once, the torch kernels a first step meets on logits like these (the non-finite check's, greedy
        argmax in their dtype and in fp32, the noise of temperature sampling), so that their lazy loading
        happens at start-up; the sampler's own state is untouched."""
        torch.isfinite(logits).all()
        logits.argmax(dim=-1)
        wide = logits.float()
        wide.argmax(dim=-1)
        wide.exponential_()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, grammar: GrammarMask | None = None
                 ) -> SamplerResult:
        """Sample one token per row. ``logits`` [N, V] is float32, bfloat16 or float16; float32 logits are used
        as scratch and modified in place, half-precision ones are never modified (a float32 copy is).
        ``grammar``: the bitmask of the constrained rows, or None (then no masking work at all)."""
        _check_logits(logits, batch)
        self.nonfinite.check(logits)
        fused = self.cuda and _fused_race_applies(batch)
        plain = batch.penalties is None and batch.banned_rows is None and not batch.truncates
        # The race kernel reads a grammar bitmask itself when nothing else changes the logits (no fp32 copy, no
        # masking pass): the same tokens as masking the copy first.
        race_mask = grammar if fused and plain else None
        untouched = plain and (grammar is None or race_mask is not None)
        if logits.dtype != torch.float32 and not (fused and untouched):
            logits = logits.float()   # exact; every path below but the kernel on untouched logits works in fp32
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties)
        if batch.banned_rows is not None:
            logits[batch.banned_rows, batch.banned_cols] = -math.inf
        if grammar is not None and race_mask is None:
            apply_grammar_mask(logits, grammar, cuda=self.cuda)
        if fused:
            return SamplerResult(self._fused_race(logits, batch, race_mask), None)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
            return SamplerResult(tokens, _logprobs(logits, tokens, batch.logprobs))
        greedy_tokens = logits.argmax(dim=-1) if batch.greedy_mask is not None else None
        if batch.temperature is not None:
            logits.div_(batch.temperature)
        lp_rows = _log_softmax_rows(logits, batch.logprobs)
        truncate_logits(logits, batch, cuda=self.cuda)
        tokens = self._race(logits, batch)
        if greedy_tokens is not None:
            tokens = torch.where(batch.greedy_mask, greedy_tokens, tokens)
        return SamplerResult(tokens, _logprobs_from(lp_rows, tokens, batch.logprobs))

    def _race(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """argmax(probs / E) with E ~ Exp(1): a sample from probs in one pass over the noise."""
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if batch.any_unseeded:
            noise.exponential_(generator=self._generator_for(probs.device))
        # Greedy rows may keep uninitialised noise: their sampled token is replaced by the argmax afterwards.
        if batch.seeded is not None:
            # One op for every seeded row, its noise keyed by (its seed, its output index) alone.
            seeded = batch.seeded
            seeded_exponential_(noise, seeded.args, seeded.args_dev, seeded.offset, cuda=self.cuda)
        return probs.div_(noise.clamp_min_(_TINY)).argmax(dim=-1)

    def _fused_race(self, logits: torch.Tensor, batch: SamplingBatch, grammar: GrammarMask | None = None
                    ) -> torch.Tensor:
        """Temperature + exponential race + greedy rows in one pass of the CUDA kernel. Its noise is keyed by
        (sampler seed, row, step, column), so unseeded rows stay reproducible run to run. Truncated batches (fp32
        logits here) are first divided by their temperature, as on the torch path, so that the threshold kernel
        and the race (at inverse temperature 1, or 0 on greedy rows) compare the very same values: the race then
        skips every logit below its row's threshold instead of the torch path's mask, softmax and noise."""
        from minillm.ops.sampling_ops import sample_exponential_race
        if batch.truncates:
            if batch.temperature is not None:
                logits.div_(batch.temperature)
            threshold = truncation_threshold(logits, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k,
                                             cuda=True).squeeze(1)
            self._fused_steps += 1
            return sample_exponential_race(logits, batch.unit_inverse_temperature(logits.device), self.seed,
                                           self._fused_steps, threshold, cuda=True)
        inv_t = batch.inverse_temperature(logits.device)
        if batch.all_greedy:
            # Inverse temperature 0 on every row: the kernel's argmax (ties to the lowest column, NaN largest, as
            # torch.argmax), read from the logits as they are (no fp32 copy of half-precision ones). No noise is
            # drawn, so the step count stays: the sampled steps' noise does not depend on how many greedy ones ran.
            return sample_exponential_race(logits, inv_t, self.seed, self._fused_steps, **_bitmask_args(grammar),
                                           cuda=True)
        self._fused_steps += 1
        return sample_exponential_race(logits, inv_t, self.seed, self._fused_steps, **_bitmask_args(grammar),
                                       cuda=True)

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
            self._generators[device].manual_seed(self.seed)
        return self._generators[device]


class NonFiniteWatch:
    """Warns once (logging, to stderr) when a step's raw logits hold NaN or inf. On the GPU only every
    GPU_EVERY-th step is checked (a checkpoint that yields NaN does so on every step, and a full pass over the
    logits each step would cost up to ~30 us at B=256); the flag is copied to pinned memory without waiting and
    read at a later step once the copy is done, so the check adds no host sync; after the warning it costs
    nothing."""

    GPU_EVERY = 64

    def __init__(self) -> None:
        self.seen = False
        self._host: torch.Tensor | None = None   # the flag in flight (one at a time)
        self._done = None                         # the event behind its copy
        self._calls = 0

    def check(self, logits: torch.Tensor) -> None:
        if self.seen:
            return
        self._calls += 1
        if logits.device.type == "cuda" and (self._calls - 1) % self.GPU_EVERY:
            return
        if logits.device.type != "cuda":
            if not bool(torch.isfinite(logits).all()):
                self._warn()
            return
        if self._done is not None:
            if not self._done.query():
                return
            self._done = None
            if bool(self._host):
                self._warn()
                return
        if self._host is None:
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._host.copy_(~torch.isfinite(logits).all(), non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def _warn(self) -> None:
        self.seen = True
        logging.getLogger("minillm").warning(
            "the model's logits hold NaN or inf: the tokens sampled from them are meaningless and logprobs are "
            "reported as null (check the checkpoint's weights and the dtype)")


def _bitmask_args(grammar: GrammarMask | None) -> dict:
    """sample_exponential_race's bitmask keywords for a grammar mask (none without one)."""
    return {} if grammar is None else {"bitmask": grammar.bitmask, "mask_rows": grammar.rows}


def _fused_race_applies(batch: SamplingBatch) -> bool:
    """The one-pass sampling op covers temperature sampling, with top-k / top-p / min-p through the threshold
    kernel, and greedy rows, all-greedy batches included: no per-request seeds (their noise is keyed by their own
    seed: SeededRows) and no logprobs (which are taken before truncation). Everything else takes the torch path.
    (The ops run their kernels on CUDA tensors and their references elsewhere; an engine only enables them with
    its CUDA kernels.)"""
    return batch.seeded is None and batch.logprobs is None


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits must have shape [{batch.num_rows}, {batch.vocab_size}] (rows x vocab_size "
                         f"of the SamplingBatch), got {list(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")


def truncate_logits(logits: torch.Tensor, batch: SamplingBatch, *, cuda: bool = False) -> None:
    """Mask (to -inf, in place) every token that top-k, top-p or min-p removes from its row. cuda: the
    threshold kernel may run (sampling_ops.truncation_threshold; its torch path elsewhere)."""
    threshold = truncation_threshold(logits, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k, cuda=cuda)
    if threshold is not None:
        logits.masked_fill_(logits < threshold, -math.inf)


def _log_softmax_rows(logits: torch.Tensor, wanted: list[int | None] | None) -> torch.Tensor | None:
    """Log-softmax of the rows that asked for logprobs (others are not computed)."""
    if wanted is None:
        return None
    rows = [i for i, n in enumerate(wanted) if n is not None]
    return logits[rows].log_softmax(dim=-1)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              wanted: list[int | None] | None) -> list[TokenLogprobs | None] | None:
    return _logprobs_from(_log_softmax_rows(logits, wanted), tokens, wanted)


def _logprobs_from(lp: torch.Tensor | None, tokens: torch.Tensor,
                   wanted: list[int | None] | None) -> list[TokenLogprobs | None] | None:
    """Sampled-token logprob plus top-N per asking row, moved to the host in a single transfer."""
    if wanted is None:
        return None
    rows = [i for i, n in enumerate(wanted) if n is not None]
    top_n = max(wanted[i] for i in rows)
    row_tokens = tokens[rows].unsqueeze(1)
    top = lp.topk(top_n, dim=-1) if top_n > 0 else None
    parts = [row_tokens.double(), lp.gather(1, row_tokens).double()]
    if top is not None:
        parts += [top.values.double(), top.indices.double()]
    host = torch.cat(parts, dim=1).tolist()
    out: list[TokenLogprobs | None] = [None] * len(wanted)
    for j, i in enumerate(rows):
        vals = host[j]
        n = wanted[i]
        top_ids = vals[2 + top_n: 2 + top_n + n]
        out[i] = TokenLogprobs(token_id=int(vals[0]), logprob=vals[1],
                               top={int(t): v for t, v in zip(top_ids, vals[2: 2 + n])})
    return out
