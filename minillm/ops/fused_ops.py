"""Fused elementwise ops of the decoder layer: one entry point each, CUDA kernel or plain torch.

The model calls only these functions. With cuda=True (the engine's execution plan says the kernels run) and a
CUDA tensor, each call goes to one fused kernel (torch.ops.minillm.*); everywhere else the torch code below runs.
The torch code is also the reference the kernels are tested against, so it stays simple and computes in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.ops.coverage import KernelCoverage
from minillm.ops.reference import kv_write_ref

# The norms, RoPE (with and without the fused KV write), SwiGLU and the one-pass sampler: fused_bindings.cpp
# (act_dtype; kMaxNormHidden, kMaxHeadDim and kMaxVocab in fused.h, which shape_reason mirrors).
COVERAGE = KernelCoverage("fused_elementwise", dtypes=("float32", "bfloat16", "float16"), graph_safe=True)
MAX_NORM_HIDDEN, MAX_HEAD_DIM, MAX_VOCAB = 8192, 256, 2147483647 - 4


def shape_reason(hidden: int, head_dim: int, vocab: int) -> str | None:
    """Why the fused kernels do not take a model of these sizes, or None."""
    if hidden > MAX_NORM_HIDDEN:
        return f"hidden_size={hidden} > {MAX_NORM_HIDDEN} (a norm row is held on chip)"
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        return f"head_dim={head_dim} (even and at most {MAX_HEAD_DIM})"
    if vocab > MAX_VOCAB:
        return f"vocab_size={vocab} > {MAX_VOCAB}"
    return None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, cuda: bool = False) -> torch.Tensor:
    """y = x / rms(x) * weight over the last dim."""
    if cuda and x.is_cuda:
        return torch.ops.minillm.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, *, cuda: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); residual None means the first layer (residual = x).

    The sum is rounded to the activation dtype before the norm, as HF's decoder layer does, so the fused
    kernel and this path agree with transformers token for token.
    """
    if residual is None:
        return rms_norm(x, weight, eps, cuda=cuda), x
    if cuda and x.is_cuda:
        return torch.ops.minillm.fused_add_rms_norm(x, residual, weight, eps)
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def silu_and_mul(gate_up: torch.Tensor, *, cuda: bool = False) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    if cuda and gate_up.is_cuda:
        return torch.ops.minillm.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float, device=None, *,
                       inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0) -> torch.Tensor:
    """fp32 [max_positions, head_dim]: cos in the first half of each row, sin in the second (neox style).

    RoPE scaling (minillm/model/rope.py) passes its own `inv_freq` [head_dim / 2] and YaRN's attention factor,
    which multiplies cos and sin here: every kernel reads this table, so none computes angles of its own."""
    # fp32 throughout, the way transformers computes it, so positions map to bit-identical angles.
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
                                    / head_dim))
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat([cos, sin], dim=-1)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; rotate-half (neox) form used by Qwen2/Qwen3; computed in fp32 like HF.
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
                 k_norm_weight: torch.Tensor | None, eps: float,
                 kv_cache_out: tuple[torch.Tensor, ...] | None = None, *, cuda: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Split packed qkv [T, (Hq + 2 Hkv) D] into q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D]; apply the per-head
    RMSNorm to q and k when weights are given (Qwen3; Qwen2 has none), then RoPE at `positions`.

    kv_cache_out = (k_cache, v_cache, slot_mapping) fuses the KV-cache write: row t of k and v goes to flat
    slot slot_mapping[t] of the caches [num_blocks, block_size, Hkv, D] (slot -1: not stored), and the call
    returns (q, None, None). The caches then hold exactly what kv_write would copy from the returned k/v.
    kv_cache_out = (k_cache, v_cache, slot_mapping, k_scale, v_scale): fp8 caches, quantized with those scales.
    """
    if cuda and qkv.is_cuda:
        if kv_cache_out is None:
            return torch.ops.minillm.qk_norm_rope(qkv, positions, cos_sin_cache, num_heads, num_kv_heads,
                                                  head_dim, q_norm_weight, k_norm_weight, eps)
        op = torch.ops.minillm.qk_norm_rope_cache if len(kv_cache_out) == 3 else torch.ops.minillm.qk_norm_rope_cache_fp8
        q = op(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps,
               *kv_cache_out)
        return q, None, None
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, num_kv_heads, head_dim)
    v = v.reshape(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    cs = cos_sin_cache[positions]
    cos, sin = cs.chunk(2, dim=-1)
    q, k = _rope_ref(q, cos, sin), _rope_ref(k, cos, sin)
    if kv_cache_out is None:
        return q, k, v
    kv_write_ref(k, v, *kv_cache_out)
    return q, None, None
