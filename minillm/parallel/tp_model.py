"""The Megatron split of a Qwen model over a tensor-parallel group.

A rank builds the ordinary QwenForCausalLM from its *local* shape (local_arch: heads, KV heads, intermediate
size and vocabulary divided by the group size), so attention, the KV cache and the kernels see nothing new; then
    - o_proj and down_proj become row-parallel (their output all-reduced over the group),
    - the embedding becomes vocab-parallel (each rank looks up its slice of the vocabulary, zeros elsewhere,
      all-reduced), and the LM head's logits are gathered to rank 0, which samples.
QKV and gate_up are column-parallel by construction: each rank's packed weight holds its heads' rows.

KV heads: with tp <= num_kv_heads each rank has num_kv_heads / tp of them; with more ranks than KV heads each
KV head is replicated on tp / num_kv_heads ranks (rank r uses head r // (tp / num_kv_heads)), and the KV cache
of each rank holds its own heads only.

Weights: every checkpoint tensor is read through safetensors' get_slice, so a rank reads only its rows or columns
(shard_tensor).
"""
from __future__ import annotations

import dataclasses

import torch

from minillm.config import ConfigError
from minillm.model.layers import Linear, VocabMatrix
from minillm.ops.gemm_ops import linear


def check_divisible(arch, tp: int) -> None:
    """ConfigError naming the first size the group cannot split."""
    if getattr(arch, "num_experts", 0):
        raise ConfigError(f"parallel.tensor_parallel_size={tp} is not allowed for a mixture-of-experts model yet "
                          "(its experts are not sharded): use tensor_parallel_size 1")
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    for what, size in (("num_attention_heads", heads), ("intermediate_size", arch.intermediate_size),
                       ("vocab_size", arch.vocab_size)):
        if size % tp:
            raise ConfigError(f"parallel.tensor_parallel_size={tp} is not allowed for this model: {what}={size} "
                              f"is not a multiple of it")
    if kv % tp and tp % kv:
        raise ConfigError(f"parallel.tensor_parallel_size={tp} is not allowed for this model: "
                          f"num_key_value_heads={kv} neither divides it nor is a multiple of it")


def local_arch(arch, tp: int):
    check_divisible(arch, tp)
    return dataclasses.replace(arch, num_attention_heads=arch.num_attention_heads // tp,
                               num_key_value_heads=max(1, arch.num_key_value_heads // tp),
                               intermediate_size=arch.intermediate_size // tp, vocab_size=arch.vocab_size // tp)


def first_kv_head(arch, tp: int, rank: int) -> int:
    kv = arch.num_key_value_heads
    return rank * kv // tp if kv >= tp else rank // (tp // kv)


def shard_kv_scales(scales: torch.Tensor, arch, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s KV heads of fp8 KV scales [layers, 2, KV heads] read against the whole model's arch (a
    checkpoint's per-head scales name every KV head; the rank's cache holds its own, or one replicated head)."""
    first = first_kv_head(arch, tp, rank)
    return scales[:, :, first:first + local_arch(arch, tp).num_key_value_heads].contiguous()


# checkpoint name suffix -> (how it splits, dim): rows/cols of the rank's heads, of the intermediate, of the vocab.
_SPLITS = (
    ("q_proj.weight", "q", 0), ("q_proj.bias", "q", 0),
    ("k_proj.weight", "kv", 0), ("k_proj.bias", "kv", 0), ("v_proj.weight", "kv", 0), ("v_proj.bias", "kv", 0),
    ("o_proj.weight", "q", 1),
    ("gate_proj.weight", "mlp", 0), ("up_proj.weight", "mlp", 0), ("down_proj.weight", "mlp", 1),
    ("embed_tokens.weight", "vocab", 0), ("lm_head.weight", "vocab", 0),
)


def shard_tensor(arch, tp: int, rank: int):
    """shard(name, view) -> this rank's part of the checkpoint tensor `name` (replicated tensors whole)."""
    local = local_arch(arch, tp)
    hd = arch.head_dim
    ranges = {"q": (rank * local.q_size, (rank + 1) * local.q_size),
              "kv": (first_kv_head(arch, tp, rank) * hd, (first_kv_head(arch, tp, rank) + local.num_key_value_heads)
                     * hd),
              "mlp": (rank * local.intermediate_size, (rank + 1) * local.intermediate_size),
              "vocab": (rank * local.vocab_size, (rank + 1) * local.vocab_size)}

    def shard(name: str, view) -> torch.Tensor:
        for suffix, kind, dim in _SPLITS:
            if name.endswith(suffix):
                start, stop = ranges[kind]
                return view[start:stop] if dim == 0 else view[:, start:stop]
        return view[:]
    return shard


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the group: the partial products are all-reduced."""

    @classmethod
    def take(cls, lin: Linear, group) -> "RowParallelLinear":
        lin.__class__ = cls   # the same module and parameters; only forward changes
        lin.group = group
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(linear(x, self.weight, self.bias, skinny=self.skinny))


class VocabParallelEmbedding(VocabMatrix):
    """This rank's rows [start, start + n) of the embedding; other ids embed to zeros, summed over the group."""

    @classmethod
    def take(cls, matrix: VocabMatrix, group) -> "VocabParallelEmbedding":
        matrix.__class__ = cls
        matrix.group = group
        matrix.start = group.rank * matrix.weight.shape[0]
        return matrix

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)


class GatheredLogits:
    """Mixed into the model class: compute_logits gathers the vocabulary slices to rank 0 (the other ranks keep
    their slice)."""

    def compute_logits(self, hidden: torch.Tensor, *, keep_dtype: bool = False):
        return self.tp_group.gather_last_dim(super().compute_logits(hidden, keep_dtype=keep_dtype))


def parallelize(net, group) -> None:
    """Turn a model built from local_arch into this rank's part of the tensor-parallel model."""
    net.__class__ = type(f"TensorParallel{type(net).__name__}", (GatheredLogits, type(net)), {})
    net.tp_group = group
    for layer in net.model.layers:
        RowParallelLinear.take(layer.self_attn.o_proj, group)
        RowParallelLinear.take(layer.mlp.down_proj, group)
    VocabParallelEmbedding.take(net.model.embed_tokens, group)
