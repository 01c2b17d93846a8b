"""ModelArchConfig: the architecture facts the engine needs, read from an HF config.json.

One frozen dataclass for both Qwen3 and Qwen2/2.5; the two differ only in `qkv_bias` (Qwen2) and `qk_norm`
(Qwen3). Configs written by transformers 4.x (top-level `rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters`, `dtype`) are both accepted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minillm.config import ConfigError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")

_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str | None = None
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArchConfig":
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config.json in model directory {Path(path)}")
        try:
            d = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelArchConfig":
        arch = _architecture(d)
        for key in _REQUIRED_INTS:
            _positive_int(d, key)
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or heads % kv_heads != 0:
            raise ConfigError(f"num_key_value_heads={kv_heads!r} is not allowed: a positive divisor of "
                              f"num_attention_heads={heads}")
        # Qwen2 configs usually omit head_dim: it is hidden_size / num_attention_heads there.
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if head_dim % 2 != 0:
            raise ConfigError(f"head_dim={head_dim} is not allowed: RoPE needs an even head dimension")
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported: only full attention is implemented")
        is_qwen3 = arch == "Qwen3ForCausalLM"
        if is_qwen3 and d.get("attention_bias"):
            # HF's Qwen3 then also puts a bias on o_proj; no released Qwen3 checkpoint does this.
            raise ConfigError("attention_bias=true is not supported for Qwen3ForCausalLM")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=_rope_theta(d),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            qkv_bias=not is_qwen3,
            qk_norm=is_qwen3,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            eos_token_id=d.get("eos_token_id"),
            bos_token_id=d.get("bos_token_id"),
        )

    # ---- derived sizes ---------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Unique parameters; a tied LM head shares the embedding and is counted once."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_hidden_layers * layer + h + lm_head

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights (LM head included) at `dtype_bytes` per element: what one decode step reads."""
        return self.num_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes


def _architecture(d: dict) -> str:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ConfigError(f"architectures={archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _positive_int(d: dict, key: str) -> None:
    if key not in d:
        raise ConfigError(f"config.json is missing {key!r}")
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{key}={v!r} is not allowed: a positive integer")


def _rope_theta(d: dict) -> float:
    # transformers 5 writes rope_parameters={rope_type, rope_theta}; 4.x wrote rope_theta + rope_scaling.
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r} is not supported: only plain RoPE (rope_scaling null / "
                          f"rope_type 'default') is implemented")
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"rope_theta={theta!r} is not allowed: a positive number")
    return float(theta)
