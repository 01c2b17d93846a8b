"""Benchmark workloads: the offline and online references (docs/architecture.md, "Reference workloads"), and
YAML workload files.

A workload is plain data (prompt token ids, per-request max_tokens, optional arrival times) so the same object
drives minillm and the HF peer. Random token ids are fine because every request ignores EOS: the work done is
fixed by the lengths alone.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from minillm.untrusted import short_repr

# The offline reference must come out to exactly these totals (docs/architecture.md).
REFERENCE_INPUT_TOKENS = 142_827
REFERENCE_OUTPUT_TOKENS = 133_966


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float
    max_model_len: int
    seed: int
    # Online workloads: arrival times (seconds) of a rate-1 Poisson process; divide by the rate to use them.
    unit_arrivals: list[float] | None = None
    params: dict = field(default_factory=dict)   # generator settings, recorded in results lines

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int | None) -> "Workload":
        """The first n requests (same draws as the full workload, so a small run is a prefix of the big one)."""
        if n is None or n == self.num_requests:
            return self
        if not isinstance(n, int) or not 1 <= n <= self.num_requests:
            raise ValueError(f"num_requests={n!r} is not allowed: an integer in [1, {self.num_requests}]")
        arrivals = None if self.unit_arrivals is None else self.unit_arrivals[:n]
        return replace(self, prompts=self.prompts[:n], max_tokens=self.max_tokens[:n], unit_arrivals=arrivals)

    def salted(self, salt: int) -> "Workload":
        """The same workload with each prompt's first token shifted by `salt`.

        NOTE: a second pass over the same prompts (a repeat, the next rate of a sweep) would otherwise be served
        from the prefix cache the first pass left behind and measure far less work. Changing the first token
        changes every block hash of the prompt while keeping all lengths, which is all the work depends on.
        """
        if salt == 0:
            return self
        top = self.params.get("max_token_id", 10000) + 1
        prompts = [[(p[0] + salt) % top, *p[1:]] for p in self.prompts]
        return replace(self, prompts=prompts)

    def arrivals(self, rate: float) -> list[float]:
        if self.unit_arrivals is None:
            raise ValueError(f"workload {self.name!r} has no arrival times (it is an offline workload)")
        if not rate > 0:
            raise ValueError(f"rate={rate!r} is not allowed: requests per second, > 0")
        return [t / rate for t in self.unit_arrivals]

    def fit(self, vocab_size: int, max_len: int) -> tuple["Workload", list[str]]:
        """This workload for a model with `vocab_size` token ids and `max_len` positions, and what changed.

        Token ids are folded into the vocabulary (t % vocab_size): every request ignores EOS, so the work depends
        on the lengths alone and stays the same. Where the model is shorter than the workload's max_model_len,
        each request that would not fit keeps its max_tokens and loses the end of its prompt (the work shrinks,
        and the notes say so)."""
        notes, prompts, max_tokens = [], self.prompts, list(self.max_tokens)
        top = self.params.get("max_token_id", 10000)
        if top >= vocab_size:
            prompts = [[t % vocab_size for t in p] for p in prompts]
            notes.append(f"token ids folded into the model's vocabulary of {vocab_size}")
        new_len = min(self.max_model_len, max_len)
        if new_len < self.max_model_len:
            cut = 0
            for i, (p, m) in enumerate(zip(prompts, max_tokens)):
                if len(p) + m > new_len:
                    max_tokens[i] = m = min(m, new_len - 1)
                    prompts[i] = p[:new_len - m]
                    cut += 1
            notes.append(f"max_model_len {self.max_model_len} -> {new_len} (the model's limit): {cut} of "
                         f"{self.num_requests} requests cut to fit")
        if not notes:
            return self, []
        params = {**self.params, "max_token_id": min(top, vocab_size - 1),
                  "fitted": {"vocab_size": vocab_size, "max_model_len": new_len}}
        return replace(self, name=f"{self.name}-fit", prompts=prompts, max_tokens=max_tokens,
                       max_model_len=new_len, params=params), notes

    def summary(self) -> dict:
        """What a results line records about the workload."""
        return {"name": self.name, "num_requests": self.num_requests, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "seed": self.seed, "temperature": self.temperature,
                "max_model_len": self.max_model_len, **self.params}


MAX_REQUESTS = 100_000          # a workload is built in memory up front
MAX_LEN = 1 << 20               # prompt/output lengths and max_model_len
MAX_PROMPT_TOKENS = 50_000_000  # all prompts together (the offline reference has 142,827)


def _check_range(name: str, value, low: int) -> tuple[int, int]:
    ok = (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_int(v) for v in value)
          and low <= value[0] <= value[1] <= MAX_LEN)
    if not ok:
        raise ValueError(f"{name}={short_repr(value)} is not allowed: a pair [lo, hi] of integers with "
                         f"{low} <= lo <= hi <= {MAX_LEN}")
    return int(value[0]), int(value[1])


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_total(num_requests: int, longest_prompt: int) -> None:
    if num_requests * longest_prompt > MAX_PROMPT_TOKENS:
        raise ValueError(f"num_requests={num_requests:,} prompts of up to {longest_prompt:,} tokens could hold "
                         f"{num_requests * longest_prompt:,} prompt tokens; the limit is {MAX_PROMPT_TOKENS:,}")


def _check_common(num_requests, max_token_id, seed, temperature, max_model_len) -> None:
    """The generator settings every workload kind shares; a workload file can hold anything."""
    checks = [("num_requests", num_requests, _is_int(num_requests) and 1 <= num_requests <= MAX_REQUESTS,
               f"an integer in [1, {MAX_REQUESTS:,}]"),
              ("max_token_id", max_token_id, _is_int(max_token_id) and 0 <= max_token_id < 2**31,
               "an integer in [0, 2**31)"),
              ("seed", seed, _is_int(seed) and 0 <= seed < 2**32, "an integer in [0, 2**32)"),
              ("temperature", temperature, isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
               and 0 <= temperature <= 1e4, "a number in [0, 1e4]"),
              ("max_model_len", max_model_len, _is_int(max_model_len) and 2 <= max_model_len <= MAX_LEN,
               f"an integer in [2, {MAX_LEN}]")]
    for name, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{name}={short_repr(value)} is not allowed: {allowed}")


def offline_workload(num_requests: int = 256, prompt_len=(100, 1024), output_len=(100, 1024),
                     max_token_id: int = 10000, seed: int = 0, temperature: float = 0.6,
                     max_model_len: int = 2048, name: str = "offline") -> Workload:
    """Random prompts drawn with Python's `random`, in the reference order.

    NOTE: all prompts are drawn first, then all max_tokens. Interleaving the two draws gives different totals;
    only this order reproduces the reference's 142,827 / 133,966 with the defaults.
    """
    _check_common(num_requests, max_token_id, seed, temperature, max_model_len)
    p_lo, p_hi = _check_range("prompt_len", prompt_len, 1)
    o_lo, o_hi = _check_range("output_len", output_len, 1)
    _check_total(num_requests, p_hi)
    if p_hi + o_hi > max_model_len:
        raise ValueError(f"max_model_len={max_model_len} is too small: prompt_len hi + output_len hi = {p_hi + o_hi}")
    random.seed(seed)
    prompts = [[random.randint(0, max_token_id) for _ in range(random.randint(p_lo, p_hi))]
               for _ in range(num_requests)]
    max_tokens = [random.randint(o_lo, o_hi) for _ in range(num_requests)]
    params = {"prompt_len": [p_lo, p_hi], "output_len": [o_lo, o_hi], "max_token_id": max_token_id}
    return Workload(name, prompts, max_tokens, temperature, max_model_len, seed, params=params)


def reference_offline() -> Workload:
    return offline_workload(name="offline-reference")


def check_reference_totals(w: Workload) -> None:
    """Raise if the full offline reference does not reproduce its documented totals (a changed generator would
    silently make every result incomparable)."""
    got = (w.input_tokens, w.output_tokens)
    want = (REFERENCE_INPUT_TOKENS, REFERENCE_OUTPUT_TOKENS)
    if got != want:
        raise RuntimeError(f"offline reference workload drifted: input/output tokens {got}, expected {want}")


def online_workload(num_requests: int = 240, short_prompt_len=(128, 512), long_prompt_len=(4096, 7680),
                    long_fraction: float = 0.1, output_len=(128, 256), max_token_id: int = 10000, seed: int = 0,
                    temperature: float = 0.6, max_model_len: int = 8192, name: str = "online") -> Workload:
    """Poisson arrivals with a short/long prompt mix, all drawn from one numpy Generator(seed).

    Draw order (fixed, so a seed names one workload): which requests are long (exactly
    round(long_fraction * n) of them), then per request its prompt length and prompt ids, then all output
    lengths, then the exponential inter-arrival gaps of a rate-1 process. Arrivals at rate r are those times / r,
    so every rate replays the same requests.
    """
    _check_common(num_requests, max_token_id, seed, temperature, max_model_len)
    if isinstance(long_fraction, bool) or not isinstance(long_fraction, (int, float)) or \
            not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction={short_repr(long_fraction)} is not allowed: a number in [0, 1]")
    s_lo, s_hi = _check_range("short_prompt_len", short_prompt_len, 1)
    l_lo, l_hi = _check_range("long_prompt_len", long_prompt_len, 1)
    o_lo, o_hi = _check_range("output_len", output_len, 1)
    _check_total(num_requests, max(s_hi, l_hi))
    if max(s_hi, l_hi) + o_hi > max_model_len:
        raise ValueError(f"max_model_len={max_model_len} is too small for prompts up to {max(s_hi, l_hi)} "
                         f"plus outputs up to {o_hi}")
    rng = np.random.default_rng(seed)
    is_long = np.zeros(num_requests, dtype=bool)
    is_long[rng.choice(num_requests, size=round(long_fraction * num_requests), replace=False)] = True
    prompts = []
    for long in is_long:
        lo, hi = (l_lo, l_hi) if long else (s_lo, s_hi)
        length = int(rng.integers(lo, hi + 1))
        prompts.append(rng.integers(0, max_token_id + 1, size=length).tolist())
    max_tokens = rng.integers(o_lo, o_hi + 1, size=num_requests).tolist()
    unit_arrivals = np.cumsum(rng.exponential(1.0, size=num_requests)).tolist()
    params = {"short_prompt_len": [s_lo, s_hi], "long_prompt_len": [l_lo, l_hi], "long_fraction": long_fraction,
              "output_len": [o_lo, o_hi], "max_token_id": max_token_id, "num_long": int(is_long.sum())}
    return Workload(name, prompts, max_tokens, temperature, max_model_len, seed, unit_arrivals, params)


_KINDS = {"offline": offline_workload, "online": online_workload}


def load_workload(path: str | Path) -> Workload:
    """A YAML file: `kind: offline|online` plus any keyword of offline_workload / online_workload.

    Example:
        kind: offline
        num_requests: 64
        prompt_len: [32, 256]
        output_len: [16, 128]
        max_model_len: 512
    """
    from minillm.config_loader import read_yaml_file
    path = Path(path).expanduser()
    data = read_yaml_file(path, "workload file") or {}
    if not isinstance(data, dict):
        raise ValueError(f"workload file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    kind = data.pop("kind", "offline")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise ValueError(f"kind={short_repr(kind)} in {str(path)!r} is not allowed: one of {', '.join(_KINDS)}")
    make = _KINDS[kind]
    allowed = set(make.__code__.co_varnames[:make.__code__.co_argcount])
    unknown = sorted(map(str, set(data) - allowed))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {str(path)!r}; allowed for kind {kind}: {sorted(allowed)}")
    data.setdefault("name", path.stem)
    if not isinstance(data["name"], str):
        raise ValueError(f"name={short_repr(data['name'])} in {str(path)!r} is not allowed: a string")
    return make(**{str(k): v for k, v in data.items()})
