"""ModelArchConfig: the architecture facts the engine needs, read from an HF config.json.

One frozen dataclass for Qwen3, Qwen3-MoE and Qwen2/2.5; Qwen2 differs by `qkv_bias` and no `qk_norm`, Qwen3-MoE
by its expert fields (`num_experts` > 0, `moe_layers`). Configs written by transformers 4.x (top-level
`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`) are both accepted; RoPE scaling
is parsed by minillm/model/rope.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minillm.config import ConfigError
from minillm.model.rope import RopeScaling, parse_rope
from minillm.untrusted import loads_json, short_repr

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)

MAX_CONFIG_BYTES = 1 << 20
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
    # Positions the model serves: config.json's value, stretched by YaRN / linear RoPE scaling where set.
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str | None = None
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    rope_scaling: RopeScaling | None = None   # None: plain RoPE at rope_theta
    # Mixture of experts (Qwen3-MoE); num_experts 0 = a dense model. moe_layers: the layers whose MLP is the
    # routed experts (the others, by mlp_only_layers / decoder_sparse_step, use the dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArchConfig":
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config.json in model directory {Path(path)}")
        if cfg.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{cfg} is {cfg.stat().st_size:,} bytes; a model config is a few KB "
                              f"(the limit is {MAX_CONFIG_BYTES:,})")
        try:
            d = loads_json(cfg.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError, TooNested, bad UTF-8
            raise ConfigError(f"{cfg} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{cfg} must hold a JSON object, got {type(d).__name__}")
        try:
            return cls.from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{cfg}: {e}") from None

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelArchConfig":
        arch = _architecture(d)
        for key in _REQUIRED_INTS:
            _positive_int(d, key)
        heads = d["num_attention_heads"]
        kv_heads = _optional(d, "num_key_value_heads", heads, _is_positive_int, "a positive integer")
        if heads % kv_heads != 0:
            raise ConfigError(f"num_key_value_heads={kv_heads!r} is not allowed: a positive divisor of "
                              f"num_attention_heads={heads}")
        # Qwen2 configs usually omit head_dim: it is hidden_size / num_attention_heads there.
        head_dim = _optional(d, "head_dim", d["hidden_size"] // heads, _is_positive_int, "a positive integer")
        if head_dim < 2:
            raise ConfigError(f"head_dim={head_dim} (hidden_size / num_attention_heads) is not allowed: at least 2")
        if head_dim % 2 != 0:
            raise ConfigError(f"head_dim={head_dim} is not allowed: RoPE needs an even head dimension")
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported: only full attention is implemented")
        is_qwen3 = arch in ("Qwen3ForCausalLM", *MOE_ARCHITECTURES)
        if is_qwen3 and d.get("attention_bias"):
            # HF's Qwen3 then also puts a bias on o_proj; no released Qwen3 checkpoint does this.
            raise ConfigError(f"attention_bias=true is not supported for {arch}")
        rope = parse_rope(d)
        max_pos = _optional(d, "max_position_embeddings", 32768, lambda v: _is_positive_int(v) and v >= 2,
                            "an integer >= 2")
        moe = _moe_fields(d) if arch in MOE_ARCHITECTURES else {}
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=rope.theta,
            rms_norm_eps=float(_optional(d, "rms_norm_eps", 1e-6, _is_positive_number, "a positive number")),
            tie_word_embeddings=_optional(d, "tie_word_embeddings", False, _is_bool, "true or false"),
            max_position_embeddings=rope.max_positions(max_pos),
            qkv_bias=not is_qwen3,
            qk_norm=is_qwen3,
            torch_dtype=_optional(d, "torch_dtype", None, _is_str, "a string") or
            _optional(d, "dtype", None, _is_str, "a string"),
            eos_token_id=_optional(d, "eos_token_id", None, _is_token_ids, "a token id or a list of token ids"),
            bos_token_id=_optional(d, "bos_token_id", None, _is_token_id, "a token id"),
            rope_scaling=None if rope.rope_type == "default" else rope,
            **moe,
        )

    # ---- derived sizes ---------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope(self) -> RopeScaling:
        return self.rope_scaling or RopeScaling(theta=self.rope_theta)

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_params(self) -> int:
        """Unique parameters; a tied LM head shares the embedding and is counted once."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        dense_layers = self.num_hidden_layers - len(self.moe_layers)
        moe_mlp = self.num_experts * (self.expert_params + h)   # experts plus the router's row per expert
        layers = self.num_hidden_layers * (attn + 2 * h) + dense_layers * 3 * h * i + len(self.moe_layers) * moe_mlp
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + layers + h + lm_head

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights (LM head included) at `dtype_bytes` per element: what one decode step reads."""
        return self.num_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes


def _architecture(d: dict) -> str:
    archs = d.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    for arch in archs:
        if isinstance(arch, str) and arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ConfigError(f"architectures={short_repr(archs)} is not supported; supported: "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _is_positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _is_positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_token_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_token_ids(v) -> bool:
    return _is_token_id(v) or (isinstance(v, list) and all(_is_token_id(t) for t in v))


def _optional(d: dict, key: str, default, ok, allowed: str):
    """d[key], or `default` where it is absent or null; a present value must pass `ok`."""
    v = d.get(key)
    if v is None:
        return default
    if not ok(v):
        raise ConfigError(f"{key}={short_repr(v)} is not allowed: {allowed}")
    return v


def _positive_int(d: dict, key: str) -> None:
    if key not in d:
        raise ConfigError(f"config.json is missing {key!r}")
    if not _is_positive_int(d[key]):
        raise ConfigError(f"{key}={short_repr(d[key])} is not allowed: a positive integer")


def _moe_fields(d: dict) -> dict:
    """The expert fields of a Qwen3-MoE config; which layers route, as HF decides it: layer i is sparse unless it
    is in mlp_only_layers, and only every decoder_sparse_step-th layer ((i + 1) % step == 0) is."""
    # transformers 5 saves num_experts as num_local_experts; hub configs say num_experts.
    key = "num_experts" if "num_experts" in d else "num_local_experts"
    _positive_int(d, key)
    experts = d[key]
    _positive_int(d, "moe_intermediate_size")
    top_k = _optional(d, "num_experts_per_tok", 8, lambda v: _is_positive_int(v) and v <= experts,
                      f"an integer in [1, {key}={experts}]")
    step = _optional(d, "decoder_sparse_step", 1, _is_positive_int, "a positive integer")
    layers = d["num_hidden_layers"]
    dense = _optional(d, "mlp_only_layers", [], lambda v: isinstance(v, list) and all(
        _is_token_id(i) and i < layers for i in v), f"a list of layer indices in [0, {layers})")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=d["moe_intermediate_size"],
                norm_topk_prob=_optional(d, "norm_topk_prob", False, _is_bool, "true or false"),
                moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))
