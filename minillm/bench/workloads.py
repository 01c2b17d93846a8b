"""Benchmark workloads: the offline and online references of DESIGN section 6, and YAML workload files.

A workload is plain data (prompt token ids, per-request max_tokens, optional arrival times) so the same object
drives minillm and the HF peer. Random token ids are fine because every request ignores EOS: the work done is
fixed by the lengths alone.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

# DESIGN section 6: the offline reference must come out to exactly these totals.
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

    def summary(self) -> dict:
        """What a results line records about the workload."""
        return {"name": self.name, "num_requests": self.num_requests, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "seed": self.seed, "temperature": self.temperature,
                "max_model_len": self.max_model_len, **self.params}


def _check_range(name: str, value, low: int) -> tuple[int, int]:
    ok = (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)
          and low <= value[0] <= value[1])
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: a pair [lo, hi] of integers with {low} <= lo <= hi")
    return int(value[0]), int(value[1])


def offline_workload(num_requests: int = 256, prompt_len=(100, 1024), output_len=(100, 1024),
                     max_token_id: int = 10000, seed: int = 0, temperature: float = 0.6,
                     max_model_len: int = 2048, name: str = "offline") -> Workload:
    """Random prompts drawn with Python's `random`, in the reference order.

    NOTE: all prompts are drawn first, then all max_tokens. Interleaving the two draws gives different totals;
    only this order reproduces DESIGN's 142,827 / 133,966 with the defaults.
    """
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests={num_requests!r} is not allowed: an integer >= 1")
    p_lo, p_hi = _check_range("prompt_len", list(prompt_len), 1)
    o_lo, o_hi = _check_range("output_len", list(output_len), 1)
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
    """Raise if the full offline reference does not reproduce DESIGN's totals (a changed generator would
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
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests={num_requests!r} is not allowed: an integer >= 1")
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction={long_fraction!r} is not allowed: a number in [0, 1]")
    s_lo, s_hi = _check_range("short_prompt_len", list(short_prompt_len), 1)
    l_lo, l_hi = _check_range("long_prompt_len", list(long_prompt_len), 1)
    o_lo, o_hi = _check_range("output_len", list(output_len), 1)
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
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"workload file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"workload file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    kind = data.pop("kind", "offline")
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r} in {str(path)!r} is not allowed: one of {', '.join(_KINDS)}")
    make = _KINDS[kind]
    allowed = set(make.__code__.co_varnames[:make.__code__.co_argcount])
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {str(path)!r}; allowed for kind {kind}: {sorted(allowed)}")
    data.setdefault("name", path.stem)
    return make(**data)
