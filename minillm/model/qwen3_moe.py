"""Qwen3-MoE: Qwen3's attention and norms with a routed mixture-of-experts MLP in `arch.moe_layers`.

The router is a bias-free [E, H] linear in the activation dtype, then softmax in fp32 and top-k (renormalised
when norm_topk_prob), as HF computes it; there is no shared expert. The other layers keep Qwen3's dense MLP.
Expert weights are stacked per layer ([E, 2I, H] gate|up, [E, H, I] down); the loader fills them from either
checkpoint layout (`Experts.checkpoint_targets`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.arch import ModelArchConfig
from minillm.model.layers import empty_param
from minillm.model.qwen3 import QwenForCausalLM
from minillm.ops import moe_ops


class Router(nn.Module):
    """The router's weight is held in fp32 whatever the model dtype, and its logits are computed in fp32: in a
    bf16 model, bf16 router logits flip near-tied expert choices against an fp32 reference (a routing flip moves
    the hidden state far more than GEMM rounding does). [E, H] is small: the cost is negligible."""

    def __init__(self, arch: ModelArchConfig, *, dtype, device):
        super().__init__()
        self.weight = empty_param(arch.num_experts, arch.hidden_size, dtype=torch.float32, device=device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path's logits; the fused path computes the same inside its routing (moe_ops.fused_route)."""
        return F.linear(x.float(), self.weight)


class Experts(nn.Module):
    """Every expert's SwiGLU weights, stacked: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj
    [E, H, I]. Parameter names match the fused 3-D checkpoint layout."""

    def __init__(self, arch: ModelArchConfig, *, dtype, device):
        super().__init__()
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.gate_up_proj = empty_param(e, 2 * i, h, dtype=dtype, device=device)
        self.down_proj = empty_param(e, h, i, dtype=dtype, device=device)

    def checkpoint_targets(self, prefix: str, names) -> dict[str, tuple[torch.Tensor, None]]:
        """Checkpoint tensor name -> the view of a stacked parameter it fills. The fused layout (transformers'
        in-memory one: `{prefix}.gate_up_proj` [E, 2I, H], `{prefix}.down_proj` [E, H, I]) fills each whole
        parameter; the hub layout (`{prefix}.{e}.{gate,up,down}_proj.weight`) fills one expert's rows at a
        time, so no second copy of the experts is ever held."""
        if f"{prefix}.gate_up_proj" in names:
            return {f"{prefix}.gate_up_proj": (self.gate_up_proj, None), f"{prefix}.down_proj": (self.down_proj, None)}
        i = self.down_proj.shape[-1]
        targets = {}
        for e in range(self.gate_up_proj.shape[0]):
            targets[f"{prefix}.{e}.gate_proj.weight"] = (self.gate_up_proj[e, :i], None)
            targets[f"{prefix}.{e}.up_proj.weight"] = (self.gate_up_proj[e, i:], None)
            targets[f"{prefix}.{e}.down_proj.weight"] = (self.down_proj[e], None)
        return targets


class SparseMoeBlock(nn.Module):
    """x [T, H] -> sum over the top-k experts of routing weight * expert(x)."""

    def __init__(self, arch: ModelArchConfig, kernels, *, dtype, device):
        super().__init__()
        self.cuda_ops = kernels.cuda
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        self.gate = Router(arch, dtype=dtype, device=device)
        self.experts = Experts(arch, dtype=dtype, device=device)
        # Decided once here, for the model's device and dtype; Qwen3MoeForCausalLM.graph_unsupported_reason
        # reports the same verdict to the runner.
        self.host_sync_reason = expert_path_reason(arch, device, dtype)
        # Steps of up to fused_rows tokens run minillm's fused routing and expert kernels (the execution plan's
        # moe verdict; moe_ops.fused_moe picks their variants by the token count); longer ones take the torch
        # path below.
        self.fused_rows = kernels.moe_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_rows and x.shape[0] <= self.fused_rows:
            return moe_ops.fused_moe(x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
                                     self.top_k, self.renormalize)
        routing = moe_ops.route(self.gate.logits(x), self.top_k, self.renormalize, weight_dtype=x.dtype)
        return moe_ops.grouped_experts(x, self.experts.gate_up_proj, self.experts.down_proj, routing,
                                       graph_safe=self.host_sync_reason is None, cuda=self.cuda_ops)


def expert_path_reason(arch: ModelArchConfig, device, dtype) -> str | None:
    """Why the experts must take the host-synced loop on this device and dtype (None: graph-safe grouped_mm)."""
    return moe_ops.grouped_mm_unsupported_reason(torch.device(device), dtype, arch.hidden_size,
                                                 arch.moe_intermediate_size)


class Qwen3MoeForCausalLM(QwenForCausalLM):
    def make_mlp(self, layer_idx: int, kernels, dtype, device) -> nn.Module | None:
        if layer_idx in self.arch.moe_layers:
            return SparseMoeBlock(self.arch, kernels, dtype=dtype, device=device)
        return None   # the dense Qwen3 MLP (mlp_only_layers, decoder_sparse_step)

    @contextlib.contextmanager
    def torch_path(self):
        """QwenForCausalLM.torch_path, with the experts on the torch path too (not the fused MoE kernels)."""
        blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        saved = [m.fused_rows for m in blocks]
        for m in blocks:
            m.fused_rows = 0
        try:
            with super().torch_path():
                yield self
        finally:
            for m, rows in zip(blocks, saved):
                m.fused_rows = rows

    def graph_unsupported_reason(self) -> str | None:
        """Why decode must not be captured in a CUDA graph: the experts' loop, which reads per-expert counts on
        the host, runs wherever grouped_mm cannot and the fused kernels do not take the step (they take decode
        steps of up to moe_rows tokens; the plan checks that against the captured batch sizes)."""
        reasons = {m.host_sync_reason for m in self.modules()
                   if isinstance(m, SparseMoeBlock) and not m.fused_rows} - {None}
        return None if not reasons else f"the mixture-of-experts layers sync with the host ({reasons.pop()})"
