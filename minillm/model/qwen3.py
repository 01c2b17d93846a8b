"""Qwen3 / Qwen2 causal LM over a flat token batch and a paged KV cache.

One class serves both architectures: Qwen2 differs by a bias on q/k/v and no per-head q/k norm, both read
from ModelArchConfig. Parameter names follow HF's with q/k/v packed into `qkv_proj` and gate/up into
`gate_up_proj` (see minillm/model/loader.py for the mapping).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from minillm.attention.metadata import AttentionMetadata
from minillm.model.arch import ModelArchConfig
from minillm.model.layers import MLP, Attention, RMSNorm, VocabMatrix
from minillm.model.rope import cos_sin_table
from minillm.ops.choice import ModelKernels
from minillm.ops.fused_ops import fused_add_rms_norm


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, attn_backend, kernels: ModelKernels, *, dtype, device,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.cuda_ops = kernels.cuda
        self.self_attn = Attention(arch, attn_backend, kernels, dtype=dtype, device=device)
        self.mlp = mlp if mlp is not None else MLP(arch, kernels, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is deferred into the next norm (fused); residual None = first layer.
        ln = self.input_layernorm
        x, residual = fused_add_rms_norm(x, residual, ln.weight, ln.eps, cuda=self.cuda_ops)
        x = self.self_attn(x, positions, cos_sin_cache, kv_cache, meta)
        ln = self.post_attention_layernorm
        x, residual = fused_add_rms_norm(x, residual, ln.weight, ln.eps, cuda=self.cuda_ops)
        return self.mlp(x), residual

class QwenModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, attn_backend, kernels: ModelKernels, *, dtype, device,
                 make_mlp=lambda layer_idx: None):
        super().__init__()
        self.cuda_ops = kernels.cuda
        self.embed_tokens = VocabMatrix(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(arch, attn_backend, kernels, dtype=dtype, device=device,
                                                 mlp=make_mlp(i)) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, input_ids, positions, cos_sin_cache, kv_caches, meta) -> torch.Tensor:
        x = self.embed_tokens.embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, cos_sin_cache, kv_cache, meta)
        # Final norm takes the last layer's pending residual add, fused like the others.
        x, _ = fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps, cuda=self.cuda_ops)
        return x

class QwenForCausalLM(nn.Module):
    """forward(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, H]; compute_logits(hidden[N]) ->
    fp32 logits[N, vocab] (model-dtype ones with keep_dtype=True). The runner picks the rows that need logits
    (last token of each sequence)."""

    def __init__(self, arch: ModelArchConfig, attn_backend, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kernels: ModelKernels | None = None):
        super().__init__()
        self.arch = arch
        self.kernels = kernels or ModelKernels()   # plain torch: a model built outside an engine
        self.model = QwenModel(arch, attn_backend, self.kernels, dtype=dtype, device=device,
                               make_mlp=lambda i: self.make_mlp(i, self.kernels, dtype, device))
        self.lm_head = None if arch.tie_word_embeddings else VocabMatrix(arch.vocab_size, arch.hidden_size,
                                                                          dtype=dtype, device=device)
        # Built once in fp32 for every position the model supports; not saved with the weights.
        # RoPE scaling (YaRN, linear) is applied in this table, so every kernel that reads it sees it.
        cache = cos_sin_table(arch.head_dim, arch.max_position_embeddings, arch.rope, device=device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def make_mlp(self, layer_idx: int, kernels: ModelKernels, dtype, device) -> nn.Module | None:
        """The MLP of layer `layer_idx`; None = the dense SwiGLU MLP (subclasses route some layers to experts)."""
        return None

    def graph_unsupported_reason(self) -> str | None:
        """Why this model's decode step cannot be captured in a CUDA graph (None: it can)."""
        return None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != self.arch.num_hidden_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} entries; the model has "
                             f"{self.arch.num_hidden_layers} layers")
        return self.model(input_ids, positions, self.cos_sin_cache, kv_caches, meta)

    @contextlib.contextmanager
    def torch_path(self):
        """Within the block the model runs plain torch on its own weights (no minillm kernel, the torch attention
        backend): the reference a fused path is checked against. Restores its kernels afterwards."""
        from minillm.attention.torch_backend import TorchAttentionBackend
        from minillm.model.layers import Attention, Linear

        saved = []
        torch_attn = TorchAttentionBackend()
        for m in self.modules():
            if hasattr(m, "cuda_ops"):
                saved.append((m, "cuda_ops", m.cuda_ops))
                m.cuda_ops = False
            if isinstance(m, Linear):
                saved.append((m, "skinny", m.skinny))
                saved.append((m, "decode_rows", m.decode_rows))
                m.skinny, m.decode_rows = False, 0
            if isinstance(m, Attention):
                saved.append((m, "attn_backend", m.attn_backend))
                m.attn_backend = torch_attn
        try:
            yield self
        finally:
            for m, name, value in saved:
                setattr(m, name, value)

    def compute_logits(self, hidden: torch.Tensor, *, keep_dtype: bool = False) -> torch.Tensor:
        """Logits [N, vocab] of hidden [N, H]: float32, or with keep_dtype the lm_head GEMM's output as it is
        (the model dtype, no float32 copy: the engine's sampler takes it so and widens it only where needed)."""
        logits = F.linear(hidden, self.lm_head_weight)
        return logits if keep_dtype else logits.float()
