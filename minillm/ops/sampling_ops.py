"""One-pass sampling op: temperature + exponential race + argmax over each row of logits.

token[r] = argmax_c(logits[r, c] * inv_temperature[r] - log(E[r, c])) with E ~ Exp(1) is a draw from
softmax(logits[r] * inv_temperature[r]) (the Gumbel-max trick); rows with inv_temperature 0 take the plain
argmax. With cuda=True and CUDA tensors this is one kernel (cuda/sampling.cu) that reads each
logit once; elsewhere the numpy reference below runs. Logits may be float32, bfloat16 or float16 (the lm_head
output as it is): both paths widen each value to float32 exactly first, so a value gives the same token
whichever of the three dtypes holds it.

The noise is counter-based, so a draw depends only on (seed, row, offset, column): Philox4x32-10 with
key = seed (low 32 bits, high 32 bits) and counter = (column // 4, row, offset low, offset high), output
word column % 4, turned into u = float32(word) * 2**-32 + 2**-33 and E = -log1p(-u). The reference
recomputes those very words, so CPU and GPU pick the same tokens except where two scores tie to within
float rounding. Callers advance `offset` every step (and keep `seed` per engine) to get fresh noise.

truncation_threshold: the per-row logit below which top-k / top-p / min-p mask a row, by one radix-select kernel
(cuda/sampling_topp.cu) with cuda=True on CUDA tensors, else by the sort-based torch path it is tested against.
"""
from __future__ import annotations

import math

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_MAX_U63 = 2**63 - 1
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The threshold kernel sums masses in 64-bit fixed point: its vocab limit (kMaxThresholdVocab, cuda/fused.h).
THRESHOLD_MAX_VOCAB = 1 << 23
# Rows per chunk in the reference, so that its uint64 temporaries stay a few tens of MB at a 152k vocab.
_REF_CHUNK_ELEMS = 1 << 22

def philox4x32_10(counter: np.ndarray, key: tuple) -> np.ndarray:
    """Philox4x32-10 of each counter: uint32 [..., 4] -> uint32 [..., 4], key = (k0, k1): ints, or arrays that
    broadcast against counter[..., 0] (one key per row)."""
    c = np.asarray(counter, dtype=np.uint32).astype(np.uint64)
    words = _philox_rounds([c[..., i].copy() for i in range(4)], key)
    return np.stack(words, axis=-1).astype(np.uint32)


def _philox_rounds(c: list[np.ndarray], key: tuple) -> list[np.ndarray]:
    """The ten rounds on the counter words c (uint64 arrays holding 32-bit values, updated in place, no
    temporaries of their size but two products)."""
    c0, c1, c2, c3 = c
    k0 = np.asarray(key[0], dtype=np.uint64) & np.uint64(_MASK32)
    k1 = np.asarray(key[1], dtype=np.uint64) & np.uint64(_MASK32)
    w0, w1, mask, m0, m1 = (np.uint64(v) for v in (_PHILOX_W0, _PHILOX_W1, _MASK32, _PHILOX_M0, _PHILOX_M1))
    shift = np.uint64(32)
    p0, p1 = np.empty_like(c0), np.empty_like(c2)
    for r in range(10):
        if r:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        np.multiply(c0, m0, out=p0)   # 32 x 32 bits: exact in uint64
        np.multiply(c2, m1, out=p1)
        np.right_shift(p1, shift, out=c0)
        c0 ^= c1
        c0 ^= k0
        np.bitwise_and(p1, mask, out=c1)
        np.right_shift(p0, shift, out=c2)
        c2 ^= c3
        c2 ^= k1
        np.bitwise_and(p0, mask, out=c3)
    return [c0, c1, c2, c3]


def race_noise(rows: range, vocab: int, seed: int, offset: int) -> np.ndarray:
    """-log(E) as float32 [len(rows), vocab] for the given row indices: the kernel's noise, word for word."""
    groups = (vocab + 3) // 4
    counter = np.zeros((len(rows), groups, 4), dtype=np.uint32)
    counter[..., 0] = np.arange(groups, dtype=np.uint32)[None, :]
    counter[..., 1] = np.asarray(rows, dtype=np.uint32)[:, None]
    counter[..., 2] = offset & _MASK32
    counter[..., 3] = (offset >> 32) & _MASK32
    words = philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    u = unit_from_words(words.reshape(len(rows), groups * 4)[:, :vocab])
    with np.errstate(divide="ignore"):  # u == 1 gives E = inf: -log(E) = -inf, a column that cannot win
        return -np.log(-np.log1p(-u))


def unit_from_words(words: np.ndarray) -> np.ndarray:
    """uint32 words -> u = float32(word) * 2**-32 + 2**-33 in (0, 1], the kernels' fp32 steps."""
    return words.astype(np.float32) * np.float32(2.0**-32) + np.float32(2.0**-33)


SEEDED_TAG = 0x53454544   # the 4th counter word of seeded rows' noise ("SEED"), apart from the race's offsets


def seeded_uniform_ref(args: np.ndarray, vocab: int, offset: int = 0) -> np.ndarray:
    """u in (0, 1] as float32 [M, vocab] for seeded rows, args = int64 [3, M] (row, seed bits, position): the
    words of cuda/sampling.cu's seeded_exponential_kernel, Philox4x32-10 with key = seed and counter =
    (column // 4, position low, position high, SEEDED_TAG), position = args[2] + offset. The row index is not an
    input: the noise of a seeded request does not depend on where it sits in the batch."""
    m, groups = args.shape[1], (vocab + 3) // 4
    seeds, pos = args[1].view(np.uint64), args[2].astype(np.uint64) + np.uint64(offset)
    mask = np.uint64(_MASK32)

    def word(column: np.ndarray) -> np.ndarray:
        return np.broadcast_to(column, (m, groups)).copy()   # writable: the rounds work in place
    counter = [word(np.arange(groups, dtype=np.uint64)[None, :]), word((pos & mask)[:, None]),
               word((pos >> np.uint64(32))[:, None]), word(np.uint64(SEEDED_TAG))]
    key = ((seeds & mask)[:, None], (seeds >> np.uint64(32))[:, None])
    words = np.stack([w.astype(np.uint32) for w in _philox_rounds(counter, key)], axis=-1)
    return unit_from_words(words.reshape(m, groups * 4)[:, :vocab])


def seeded_uniform_torch(args: torch.Tensor, vocab: int, offset: int = 0) -> torch.Tensor:
    """seeded_uniform_ref in torch int64 ops on args' device, for a GPU without the kernel: the same words (each
    32 x 32-bit product is split in 16-bit halves, so nothing overflows int64), the same fp32 steps."""
    m, groups = args.shape[1], (vocab + 3) // 4
    seeds, pos = args[1], args[2] + offset
    shape = (m, groups)
    counter = [torch.arange(groups, device=args.device).expand(shape), (pos & _MASK32)[:, None].expand(shape),
               ((pos >> 32) & _MASK32)[:, None].expand(shape), torch.full(shape, SEEDED_TAG, device=args.device)]
    key = [(seeds & _MASK32)[:, None], ((seeds >> 32) & _MASK32)[:, None]]   # & undoes the sign of >>
    words = torch.stack(_philox_rounds_torch(counter, key), dim=-1).reshape(m, 4 * groups)[:, :vocab]
    return words.float() * 2.0**-32 + 2.0**-33


def _philox_rounds_torch(c: list[torch.Tensor], key: list[torch.Tensor]) -> list[torch.Tensor]:
    c0, c1, c2, c3 = c
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mul_hi_lo(c0, _PHILOX_M0)
        hi1, lo1 = _mul_hi_lo(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def _mul_hi_lo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * m for 32-bit a and m, in int64 without overflow."""
    low = (a & 0xFFFF) * m           # < 2**48
    high = (a >> 16) * m             # < 2**48
    return (high + (low >> 16)) >> 16, (((high & 0xFFFF) << 16) + low) & _MASK32


def seeded_exponential_(noise: torch.Tensor, args: np.ndarray, args_dev: torch.Tensor, offset: int = 0, *,
                        cuda: bool = False) -> None:
    """Write E ~ Exp(1) into the seeded rows of noise [N, V] (float32, in place): E = -log1p(-u) with u from
    seeded_uniform_ref. args: int64 [3, M] (row, seed bits, position) on the host; args_dev: the same on noise's
    device; offset: added to every position. With cuda=True and a CUDA tensor this is one kernel (whose log1pf
    is the one torch's CUDA log1p calls, so the two agree bit for bit); elsewhere the same words (numpy on the
    CPU, seeded_uniform_torch on another device), then torch.log1p there."""
    if cuda and noise.is_cuda:
        torch.ops.minillm.seeded_exponential_(noise, args_dev, offset)
        return
    if noise.device.type == "cpu":
        u = torch.from_numpy(seeded_uniform_ref(args, noise.shape[1], offset))
    else:
        u = seeded_uniform_torch(args_dev, noise.shape[1], offset)
    noise[args_dev[0]] = u.neg_().log1p_().neg_()


def _check_args(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int, offset: int) -> None:
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES or logits.shape[1] < 1:
        raise ValueError(f"logits must be float32, bfloat16 or float16 [N, V] with V >= 1, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if inv_temperature.shape != (logits.shape[0],) or inv_temperature.dtype != torch.float32:
        raise ValueError(f"inv_temperature must be float32 [{logits.shape[0]}], got "
                         f"{inv_temperature.dtype} {tuple(inv_temperature.shape)}")
    if inv_temperature.device != logits.device:
        raise ValueError(f"inv_temperature must be on logits' device {logits.device}, got {inv_temperature.device}")
    for name, value in (("seed", seed), ("offset", offset)):
        if not isinstance(value, int) or not 0 <= value <= _MAX_U63:
            raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")


def sample_exponential_race_ref(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int,
                                offset: int, threshold: torch.Tensor | None = None,
                                bitmask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None
                                ) -> torch.Tensor:
    """Reference of the kernel in numpy fp32: the same noise words, the same fp32 steps. int64 [N].
    Half-precision logits are widened to fp32 first (exact), as the kernel does; logits below their row's
    threshold (float32 [N], optional), or forbidden by a constrained row's grammar bitmask, become -inf."""
    _check_args(logits, inv_temperature, seed, offset)
    x = logits.detach().float().cpu().numpy()
    if bitmask is not None:
        _mask_columns(x, bitmask, mask_rows)
    if threshold is not None:
        x = np.where(x < threshold.detach().float().cpu().numpy()[:, None], np.float32(-np.inf), x)
    inv_t = inv_temperature.detach().cpu().numpy()
    n, vocab = x.shape
    out = np.empty(n, dtype=np.int64)
    step = max(1, _REF_CHUNK_ELEMS // vocab)
    for start in range(0, n, step):
        rows = range(start, min(n, start + step))
        scores = x[rows.start:rows.stop] * inv_t[rows.start:rows.stop, None] + race_noise(rows, vocab, seed, offset)
        out[rows.start:rows.stop] = scores.argmax(axis=1)  # numpy, like torch: first max, NaN largest
    greedy = inv_t == 0
    out[greedy] = x[greedy].argmax(axis=1)
    return torch.from_numpy(out).to(logits.device)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [M, vocab_size]: which tokens each row's bitmask allows."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    octets = bitmask.contiguous().view(torch.uint8)            # little-endian: token 8 * b + j is bit j of byte b
    bits = (octets.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _mask_columns(x: np.ndarray, bitmask: torch.Tensor, mask_rows: torch.Tensor | None) -> None:
    """x [N, V] in place: -inf where a listed row's bitmask (int32 words, bit j of word w = column 32 w + j)
    has a clear bit."""
    allowed = allowed_tokens(bitmask.detach().cpu(), x.shape[1]).numpy()
    rows = np.arange(x.shape[0]) if mask_rows is None else mask_rows.detach().cpu().numpy()
    x[rows] = np.where(allowed, x[rows], np.float32(-np.inf))


def sample_exponential_race(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int,
                            offset: int, threshold: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                            mask_rows: torch.Tensor | None = None, *, cuda: bool = False) -> torch.Tensor:
    """One token per row of logits [N, V] (float32, bfloat16 or float16): a draw from
    softmax(logits * inv_temperature), or the argmax where inv_temperature is 0. inv_temperature must be >= 0
    (not checked on the device: that would sync). threshold: float32 [N] or None; a row's logits below it cannot
    be drawn (truncation_threshold's masking, without writing the logits). bitmask: int32 [M, ceil(V / 32)], a
    grammar bitmask (xgrammar's layout) of the rows mask_rows lists (int64 [M], ascending; None: every row in
    order); a column whose bit is clear cannot be drawn, also without writing the logits. Not with a threshold
    (that one would have to come from the masked logits). Returns int64 [N] on logits' device."""
    _check_args(logits, inv_temperature, seed, offset)
    if threshold is not None and bitmask is not None:
        raise ValueError("sample_exponential_race takes a threshold or a grammar bitmask, not both")
    if cuda and logits.is_cuda:
        return torch.ops.minillm.sample_exponential_race(logits, inv_temperature, seed, offset, 0, threshold,
                                                         bitmask, mask_rows)
    return sample_exponential_race_ref(logits, inv_temperature, seed, offset, threshold, bitmask, mask_rows)


def truncation_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                         min_p: torch.Tensor | None, max_top_k: int = 0, *, cuda: bool = False
                         ) -> torch.Tensor | None:
    """Per-row logit threshold [N, 1] below which top-k, top-p and min-p mask fp32 logits [N, V] (after
    temperature), or None when none of them is given. top_k: int64 [N] (V = off), top_p: [N] (1 = off), min_p:
    [N] (0 = off); max_top_k: the largest top_k below V (the torch path's topk width). The top-p rule, on the
    row's descending order: keep the first min(k, kept_p) tokens, where a token is kept by top-p when the
    renormalised top-k mass strictly before it is < p (so the token that crosses p stays), at least one; ties of
    the last kept value stay too (the caller masks `logit < threshold`). Then min-p: p >= min_p * p_max, i.e.
    logit >= max + log(min_p).
    With cuda=True and CUDA logits (vocab <= THRESHOLD_MAX_VOCAB) this is one kernel without a sort
    (cuda/sampling_topp.cu); it sums masses in fixed point rather than by the sort's float32 cumsum, so at a row's
    exact top-p boundary (a token whose preceding mass is within rounding of p) the two may keep one token more or
    less. Elsewhere the torch path below."""
    if top_k is None and top_p is None and min_p is None:
        return None
    if cuda and logits.is_cuda and logits.shape[1] <= THRESHOLD_MAX_VOCAB:
        log_min_p = min_p.float().log().contiguous() if min_p is not None else None
        p = top_p.float().contiguous() if top_p is not None else None
        return torch.ops.minillm.truncation_threshold(logits, top_k, p, log_min_p).unsqueeze(1)
    return truncation_threshold_torch(logits, top_k, top_p, min_p, max_top_k)


def truncation_threshold_torch(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                               min_p: torch.Tensor | None, max_top_k: int = 0) -> torch.Tensor | None:
    """truncation_threshold in torch ops (the kernel's reference): one sort when top-p is on, a topk of width
    max_top_k for top-k alone, an amax for min-p."""
    if top_p is not None:
        threshold = _top_k_top_p_threshold(logits, top_k, top_p)
    elif top_k is not None:
        threshold = _top_k_threshold(logits, top_k, max_top_k)
    else:
        threshold = None
    if min_p is not None:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p): no softmax needed (log(0) = -inf keeps all).
        min_p_thr = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
        threshold = min_p_thr if threshold is None else torch.maximum(threshold, min_p_thr)
    return threshold


def _top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """k-th largest logit per row via one topk of the batch's largest k (no full sort)."""
    vocab = logits.shape[1]
    width = max(1, min(max_top_k, vocab))
    values = logits.topk(width, dim=-1).values
    k = top_k.unsqueeze(1)
    kth = values.gather(1, (k.clamp(min=1, max=width) - 1))
    return torch.where(k < vocab, kth, -math.inf)


def _top_k_top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """One descending sort serves both: keep the first min(k, kept_p) tokens, where a token is kept by top-p
    when the renormalised top-k mass strictly before it is < p (so the token that crosses p stays)."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    vocab = logits.shape[1]
    k = top_k if top_k is not None else torch.full_like(top_p, vocab, dtype=torch.int64)
    k = k.unsqueeze(1)
    top_k_mass = cum.gather(1, k - 1)
    kept_p = ((cum - probs) < top_p.unsqueeze(1) * top_k_mass).sum(dim=-1, keepdim=True)
    kept = torch.where(top_p.unsqueeze(1) < 1.0, torch.minimum(kept_p, k).clamp_min(1), k)
    threshold = sorted_logits.gather(1, kept - 1)
    return torch.where(kept < vocab, threshold, -math.inf)
