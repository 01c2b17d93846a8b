"""Building blocks of the Qwen decoder: packed linear layers, RMSNorm, attention and SwiGLU MLP.

Parameters are created with torch.empty (no init kernels): the loader fills them from safetensors or with
dummy random values, so building even the 0.6B shape costs no extra pass over memory. All elementwise math
goes through minillm.ops.fused_ops, where the CUDA kernels plug in; whether they run, and which linear layers
take the skinny GEMM or the decode GEMM, is the engine's plan (minillm/runner/plan.py), handed to every layer
that calls a kernel as a ModelKernels (minillm/ops/choice.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.attention.metadata import AttentionMetadata
from minillm.model.arch import ModelArchConfig
from minillm.ops.fused_ops import qk_norm_rope, silu_and_mul
from minillm.ops.gemm_ops import linear


def empty_param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` names the row ranges of a packed weight, e.g. {"q": (0, 2048), ...}, so the
    loader can copy each checkpoint tensor straight into its slice."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, device,
                 shards: dict[str, tuple[int, int]] | None = None, skinny: bool = False, decode_rows: int = 0):
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.shards = shards or {}
        self.skinny = skinny      # the plan put this layer's decode-sized products on the skinny GEMM
        self.decode_rows = decode_rows   # ... and those of up to this many rows on the decode GEMM (0: none)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, skinny=self.skinny, decode_rows=self.decode_rows)


class VocabMatrix(nn.Module):
    """A [vocab, hidden] weight: the token embedding (embed) or an untied LM head (used through F.linear by the
    model). A tensor-parallel rank holds a slice of the vocabulary (minillm/parallel/tp_model.py)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, device):
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size, dtype=dtype, device=device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """Holds the weight and eps; the computation is a fused_ops call made by the caller (with or without the
    residual add), so the module has no forward of its own."""

    def __init__(self, dim: int, eps: float, *, dtype, device):
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype, device=device)
        self.eps = eps


def _row_shards(sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    shards, start = {}, 0
    for name, size in sizes.items():
        shards[name] = (start, start + size)
        start += size
    return shards


class Attention(nn.Module):
    """QKV in one GEMM, optional per-head q/k norm (Qwen3), RoPE, paged attention, output projection."""

    def __init__(self, arch: ModelArchConfig, attn_backend, kernels, *, dtype, device):
        super().__init__()
        self.cuda_ops = kernels.cuda
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.eps = arch.rms_norm_eps
        self.scale = arch.head_dim ** -0.5
        self.attn_backend = attn_backend
        shards = _row_shards({"q": arch.q_size, "k": arch.kv_size, "v": arch.kv_size})
        self.qkv_proj = Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias,
                               dtype=dtype, device=device, shards=shards, skinny=kernels.skinny_for("qkv_proj"),
                               decode_rows=kernels.decode_rows_for("qkv_proj"))
        self.o_proj = Linear(arch.q_size, arch.hidden_size, bias=False, dtype=dtype, device=device,
                             skinny=kernels.skinny_for("o_proj"), decode_rows=kernels.decode_rows_for("o_proj"))
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        # Where the backend can, qk_norm_rope stores k/v straight into the cache (one kernel and one trip of k/v
        # through memory less per layer); k and v are then None and the backend skips its own KV write.
        target = self.attn_backend.fused_kv_write_target(qkv, self.num_heads, self.head_dim, k_cache, v_cache, meta)
        q, k, v = qk_norm_rope(
            qkv, positions, cos_sin_cache, self.num_heads, self.num_kv_heads, self.head_dim,
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None, self.eps, kv_cache_out=target,
            cuda=self.cuda_ops)
        out = self.attn_backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU with gate and up packed into one GEMM: down(silu(gate(x)) * up(x))."""

    def __init__(self, arch: ModelArchConfig, kernels, *, dtype, device):
        super().__init__()
        i = arch.intermediate_size
        self.cuda_ops = kernels.cuda
        self.gate_up_proj = Linear(arch.hidden_size, 2 * i, bias=False, dtype=dtype, device=device,
                                   shards=_row_shards({"gate": i, "up": i}), skinny=kernels.skinny_for("gate_up_proj"),
                                   decode_rows=kernels.decode_rows_for("gate_up_proj"))
        self.down_proj = Linear(i, arch.hidden_size, bias=False, dtype=dtype, device=device,
                                skinny=kernels.skinny_for("down_proj"),
                                decode_rows=kernels.decode_rows_for("down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), cuda=self.cuda_ops))
