"""RoPE scaling read from config.json, computed the way HF transformers 5 computes it.

Supported rope types: `default`, `linear` (inverse frequencies divided by `factor`) and `yarn` (NTK-by-parts
interpolation between the original and the scaled frequencies over a ramp of dimensions, plus an attention
factor that scales cos and sin). Every other type is refused by name.

The scaling lives entirely in the fp32 cos/sin table (`cos_sin_table`): the torch path, the fused qk_norm_rope
kernel and the decode megakernel all read that table, so each path sees the same scaled angles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minillm.config import ConfigError
from minillm.ops.fused_ops import rope_cos_sin_cache
from minillm.untrusted import short_repr

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")
_DEFAULT_THETA = 10000.0
# Keys each type may carry (HF's validators); an unknown key is refused rather than silently ignored.
_ALLOWED_KEYS = {
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor"},
    "yarn": {"rope_theta", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}


@dataclass(frozen=True)
class RopeScaling:
    """The resolved RoPE parameters: every default filled in, so the table needs nothing else."""
    rope_type: str = "default"
    theta: float = _DEFAULT_THETA
    factor: float = 1.0
    original_max_position_embeddings: int | None = None   # yarn only
    attention_factor: float = 1.0                          # multiplies cos and sin (yarn)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def max_positions(self, max_position_embeddings: int) -> int:
        """Positions the scaled model serves: YaRN stretches its pretraining length by `factor`, linear scaling
        stretches max_position_embeddings (what vLLM derives too); never fewer than the config states."""
        if self.rope_type == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        if self.rope_type == "linear":
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings

    def inv_freq(self, head_dim: int, device=None) -> torch.Tensor:
        """fp32 [head_dim / 2], with HF's exact operation order (so the angles are bit-identical)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        if self.rope_type == "default":
            return 1.0 / (self.theta ** exponents)
        if self.rope_type == "linear":
            return 1.0 / (self.theta ** exponents) / self.factor
        return self._yarn_inv_freq(head_dim, device)

    def _yarn_inv_freq(self, dim: int, device) -> torch.Tensor:
        base, orig = self.theta, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001   # a zero-width ramp would divide by zero
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        keep = 1 - ramp          # 1: the dimension keeps its original frequency (fast rotations)
        return interpolation * (1 - keep) + extrapolation * keep


def cos_sin_table(head_dim: int, max_positions: int, rope: RopeScaling, device=None) -> torch.Tensor:
    """The fp32 cos/sin table of `rope` (see fused_ops.rope_cos_sin_cache for the layout)."""
    return rope_cos_sin_cache(head_dim, max_positions, rope.theta, device, inv_freq=rope.inv_freq(head_dim, device),
                              attention_factor=rope.attention_factor)


# ---------------------------------------------------------------- config.json

def parse_rope(d: dict) -> RopeScaling:
    """RopeScaling from an HF config dict: transformers 4.x (`rope_theta` + `rope_scaling` with `rope_type` or
    the older `type`) or 5.x (`rope_parameters`, which carries rope_theta). As in transformers, rope_scaling
    wins over rope_parameters where both are present, and a rope_theta inside the dict over a top-level one."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters / rope_scaling={short_repr(params)} is not allowed: an object or null")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {short_repr(rope_type)} is not supported: supported rope types are "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    unknown = sorted(map(str, set(params) - _ALLOWED_KEYS[rope_type] - {"rope_type", "type"}))
    if unknown:
        raise ConfigError(f"rope type {rope_type!r} does not take {', '.join(unknown)} (allowed: "
                          f"{', '.join(sorted(_ALLOWED_KEYS[rope_type]))})")
    theta = params.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta", _DEFAULT_THETA)
    theta = _number(theta, "rope_theta", low=0.0, strict=True)
    if rope_type == "default":
        return RopeScaling(theta=theta)
    if rope_type == "linear":
        return RopeScaling("linear", theta, _number(params.get("factor"), "factor", low=1.0))
    return _parse_yarn(d, params, theta)


def _parse_yarn(d: dict, params: dict, theta: float) -> RopeScaling:
    max_pos = d.get("max_position_embeddings", 32768)
    # transformers gives a top-level original_max_position_embeddings priority over the one in the dict.
    orig = d.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))
    if not (isinstance(orig, int) and not isinstance(orig, bool) and orig >= 1):
        raise ConfigError(f"original_max_position_embeddings={short_repr(orig)} is not allowed: a positive integer")
    factor = params.get("factor")
    if factor is None and isinstance(max_pos, int) and not isinstance(max_pos, bool):
        factor = max_pos / orig   # transformers' fallback: the ratio of the two lengths
    factor = _number(factor, "factor", low=1.0)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            mscale = _number(mscale, "mscale", low=0.0)
            mscale_all_dim = _number(mscale_all_dim, "mscale_all_dim", low=0.0)
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    attention_factor = _number(attention_factor, "attention_factor", low=0.0, strict=True)
    # transformers: `or` defaults, so 0 and null both mean the paper's values.
    beta_fast = _number(params.get("beta_fast") or 32, "beta_fast", low=0.0, strict=True)
    beta_slow = _number(params.get("beta_slow") or 1, "beta_slow", low=0.0, strict=True)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"truncate={short_repr(truncate)} is not allowed: true or false")
    return RopeScaling("yarn", theta, factor, orig, attention_factor, beta_fast, beta_slow, truncate)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(v, key: str, *, low: float, strict: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
        (v > low if strict else v >= low)
    if not ok:
        raise ConfigError(f"{key}={short_repr(v)} is not allowed: a number {'>' if strict else '>='} {low:g}")
    return float(v)
