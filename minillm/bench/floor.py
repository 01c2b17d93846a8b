"""The hardware floor of a workload (docs/architecture.md, section 7): the least time any engine could take on this GPU.

floor seconds = (KV bytes + weight bytes) / measured copy bandwidth + prefill FLOPs / measured GEMM rate

- KV bytes: the step that produces output token k (k = 0 .. max_tokens-1) of a request with a P-token prompt
  must read the K and V of the P + k tokens before it, so a request reads
  sum_k (P + k) = M*P + M*(M-1)/2 token-KVs, each 2 x layers x kv_heads x head_dim x the cache's element bytes
  (the model dtype's, or 1 for an fp8 cache: kv_elem_bytes). An fp8 run also states the floor it would have with
  a cache in the model dtype (floor_record's *_model_dtype_kv fields), so both are on its line.
- Weight bytes: every forward step reads all weights once (the LM head included; the embedding table is only
  gathered, a few rows per step, so it is not counted unless it is tied and doubles as the LM head).
  The number of steps is the fewest any schedule can use: at least max(max_tokens) (a request gains at most
  one token per step) and at least ceil(sum(max_tokens) / max_num_seqs) (a step holds at most max_num_seqs
  requests).
  Mixture-of-experts layers read only the experts the step's tokens are routed to. Under uniform routing, each
  of B tokens picks k of E experts, so an expert is missed by all of them with probability (1 - k/E)^B and a
  step touches E * (1 - (1 - k/E)^B) distinct experts per layer in expectation (Qwen3-30B-A3B: 8 of 128 at
  B = 1, about 6 GB a step in bf16; 125.9 at B = 64, 59.5 of the 60.4 GB that reading every expert takes). A
  workload's B is its mean decode batch, sum(max_tokens) / steps: an expected value, not a bound (real routing
  is not uniform).
- Prefill FLOPs: 2 x (layer matmul params a token passes through: its k experts, not all E) per prompt token,
  the LM head once per request (only the last prompt position needs logits), plus causal attention (QK^T and
  PV: 4 x q_heads x head_dim FLOPs per query-key pair, P*(P+1)/2 pairs per layer). Decode FLOPs are left out:
  decode is bound by the bytes above.

The bandwidth and GEMM rate are measured on the device at the start of a run; without a GPU they are None and
so is the floor (a CPU floor would say nothing about the engine).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_KV_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Mixture of experts: 0 experts = dense. num_moe_layers of the layers route to experts, the rest are dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0

    @classmethod
    def from_arch(cls, arch) -> "ModelShape":
        """From any object with these attribute names (minillm's model_arch or a transformers config).
        Configs without head_dim (Qwen2) imply hidden_size / num_attention_heads; MoE layers come from
        minillm's `moe_layers` or transformers' mlp_only_layers / decoder_sparse_step."""
        values = {name: getattr(arch, name, None) for name in cls.__dataclass_fields__}
        if values["head_dim"] is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        values["num_moe_layers"] = _num_moe_layers(arch)
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            values[name] = (values[name] or 0) if values["num_moe_layers"] else 0
        return cls(**{name: int(v) for name, v in values.items()})

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return (h * (q + 2 * kv) + q * h) * self.num_hidden_layers

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size * (self.num_hidden_layers - self.num_moe_layers)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.num_experts * self.hidden_size * self.num_moe_layers

    @property
    def layer_matmul_params(self) -> int:
        """Weights one token passes through in all decoder layers (q, k, v, o, and gate, up, down of the dense
        MLP or of its k experts plus the router)."""
        routed = self.num_moe_layers * self.num_experts_per_tok * self.expert_params
        return self.attention_params + self.dense_mlp_params + routed + self.router_params

    @property
    def norm_params(self) -> int:
        # two RMSNorms per layer, q/k norms (Qwen3), the final norm
        per_layer = 2 * self.hidden_size + 2 * self.head_dim
        return per_layer * self.num_hidden_layers + self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def experts_touched(self, batch: int | None) -> float:
        """Expected distinct experts a step of `batch` tokens reads per MoE layer under uniform routing,
        E * (1 - (1 - k/E)^B); batch None = all of them."""
        e, k = self.num_experts, self.num_experts_per_tok
        if not e or batch is None:
            return float(e)
        return e * (1.0 - (1.0 - k / e) ** batch)

    def step_weight_bytes(self, dtype_bytes: int, batch: int | None = None) -> int:
        """Bytes of weights a forward step over `batch` tokens reads (dense models: all of them, whatever B)."""
        experts = round(self.experts_touched(batch) * self.expert_params * self.num_moe_layers)
        dense = self.attention_params + self.dense_mlp_params + self.router_params
        return (dense + experts + self.norm_params + self.lm_head_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _num_moe_layers(arch) -> int:
    layers = getattr(arch, "moe_layers", None)
    if layers is not None:
        return len(layers)
    experts = getattr(arch, "num_experts", None) or 0
    if not experts:
        return 0
    dense = set(getattr(arch, "mlp_only_layers", None) or [])
    step = getattr(arch, "decoder_sparse_step", None) or 1
    return sum(1 for i in range(arch.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype or its name."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def kv_elem_bytes(kv_cache_dtype: str, model_dtype) -> int:
    """Bytes per cached K or V element under cache.kv_cache_dtype (auto = the model dtype)."""
    if kv_cache_dtype in _KV_FP8:
        return 1
    return dtype_bytes(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


@dataclass(frozen=True)
class FloorWork:
    """What a workload must move and compute, independent of the engine."""
    kv_bytes: int
    weight_bytes: int
    num_steps: int
    prefill_flops: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.weight_bytes


def workload_work(shape: ModelShape, prompt_lens: list[int], max_tokens: list[int], dtype_bytes_: int,
                  max_num_seqs: int, kv_bytes_: int | None = None) -> FloorWork:
    """kv_bytes_: the cache's element bytes (None = dtype_bytes_, a cache in the model dtype)."""
    if len(prompt_lens) != len(max_tokens) or not prompt_lens:
        raise ValueError("prompt_lens and max_tokens must be non-empty lists of the same length")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} is not allowed: an integer >= 1")
    token_kvs = sum(m * p + m * (m - 1) // 2 for p, m in zip(prompt_lens, max_tokens))
    num_steps = max(max(max_tokens), -(-sum(max_tokens) // max_num_seqs))
    q_width = shape.num_attention_heads * shape.head_dim
    attn_pairs = sum(p * (p + 1) // 2 for p in prompt_lens) * shape.num_hidden_layers
    prefill_flops = (2 * shape.layer_matmul_params * sum(prompt_lens)
                     + 2 * shape.lm_head_params * len(prompt_lens) + 4 * q_width * attn_pairs)
    mean_batch = -(-sum(max_tokens) // num_steps)   # only MoE weights depend on it
    kv_elem = dtype_bytes_ if kv_bytes_ is None else kv_bytes_
    return FloorWork(kv_bytes=token_kvs * shape.kv_bytes_per_token(kv_elem),
                     weight_bytes=num_steps * shape.step_weight_bytes(dtype_bytes_, mean_batch),
                     num_steps=num_steps, prefill_flops=prefill_flops)


def floor_seconds(work: FloorWork, copy_bytes_per_s: float | None, gemm_flops_per_s: float | None) -> float | None:
    if not copy_bytes_per_s or not gemm_flops_per_s:
        return None
    return work.total_bytes / copy_bytes_per_s + work.prefill_flops / gemm_flops_per_s


def _time_cuda(fn, iters: int) -> float:
    """Median seconds per call, timed with CUDA events after one untimed call."""
    import torch

    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure_copy_bandwidth(device, nbytes: int = 2 << 30, iters: int = 10) -> float | None:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written. None off CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src), iters)
    del src, dst
    return 2 * nbytes / seconds


def measure_gemm_rate(device, n: int = 8192, iters: int = 10) -> float | None:
    """Square bf16 matmul rate in FLOP/s (cuBLAS, the best a prefill GEMM can hope for). None off CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    seconds = _time_cuda(lambda: a @ b, iters)
    del a, b
    return 2 * n**3 / seconds


@dataclass(frozen=True)
class DeviceRates:
    copy_bytes_per_s: float | None
    gemm_flops_per_s: float | None
    measure_s: float


def measure_device(device) -> DeviceRates:
    t0 = time.perf_counter()
    bw = measure_copy_bandwidth(device)
    rate = measure_gemm_rate(device)
    return DeviceRates(bw, rate, time.perf_counter() - t0)


def floor_record(work: FloorWork, rates: DeviceRates, wall_s: float | None,
                 model_dtype_kv_work: FloorWork | None = None) -> dict:
    """The floor fields of a results line; floor_s and fraction are null where rates were not measured.
    model_dtype_kv_work: the same workload with the cache in the model dtype (an fp8 run), stated alongside."""
    floor_s = floor_seconds(work, rates.copy_bytes_per_s, rates.gemm_flops_per_s)
    fraction = floor_s / wall_s if floor_s is not None and wall_s else None
    rec = {**asdict(work), "copy_bytes_per_s": rates.copy_bytes_per_s, "gemm_flops_per_s": rates.gemm_flops_per_s,
           "floor_s": floor_s, "fraction_of_floor": fraction}
    if model_dtype_kv_work is not None and model_dtype_kv_work != work:
        other = floor_seconds(model_dtype_kv_work, rates.copy_bytes_per_s, rates.gemm_flops_per_s)
        rec.update(kv_bytes_model_dtype_kv=model_dtype_kv_work.kv_bytes, floor_s_model_dtype_kv=other,
                   fraction_of_floor_model_dtype_kv=other / wall_s if other is not None and wall_s else None)
    return rec
