"""Per-request sampling parameters, validated at construction so bad values never reach the engine."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from minillm.structured.spec import GrammarSpec
from minillm.untrusted import short_repr

# The per-row scalars the sampler reads every step, in the order of SamplingParams.packed_row() (and of the rows of
# minillm/sampling/batch.py's parameter matrix). The last three are host-only flags: min_tokens, whether a seed is
# set, whether logprobs are wanted.
MAX_TEMPERATURE = 1e4           # far past uniform sampling already; logits / T stays a normal float32
MIN_REPETITION_PENALTY = 1e-2    # logits are divided (or multiplied) by it: keep them finite in float32
ROW_FIELDS = ("temperature", "top_p", "min_p", "top_k", "presence", "frequency", "repetition",
              "min_tokens", "seeded", "logprobs")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the sampled one)
    structured: GrammarSpec | None = None   # the grammar the output must match (minillm/structured/)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Only a list (or tuple) is a list here: list() of a dict or a string would silently take its keys/chars.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {short_repr(value)}")
            setattr(self, name, list(value or []))
        self._validate()

    def packed_row(self) -> bytes:
        """ROW_FIELDS as float32 bytes: a request packs them once, and joining 256 packed rows is ~100x cheaper
        than converting 256 tuples every step."""
        return np.array((self.temperature, self.top_p, self.min_p, self.top_k, self.presence_penalty,
                         self.frequency_penalty, self.repetition_penalty, self.min_tokens, self.seed is not None,
                         self.logprobs is not None), dtype=np.float32).tobytes()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {short_repr(getattr(self, name))}")

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        # Upper bounds keep every value the sampler packs into float32 finite there.
        if not is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"a finite number >= 0 (at most {MAX_TEMPERATURE:g})")
        if not is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            raise bad("top_k", "an integer >= 0 (0 or -1 disables it), below 2**31")
        if not is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "in [0, 1]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "true or false")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an integer or null")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not math.isfinite(v) or not (-2.0 <= v <= 2.0):
                raise bad(name, "in [-2, 2]")
        if not is_num(self.repetition_penalty) or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= \
                1 / MIN_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"a number in [{MIN_REPETITION_PENALTY:g}, {1 / MIN_REPETITION_PENALTY:g}]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not (0 <= self.logprobs <= 20)):
            raise bad("logprobs", "an integer in [0, 20] or null")
        if self.structured is not None:
            if not isinstance(self.structured, GrammarSpec):
                raise bad("structured", "a GrammarSpec or null")
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a structured output constraint: the grammar "
                                 "ends the output with EOS")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
