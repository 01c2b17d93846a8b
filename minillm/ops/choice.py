"""Whether minillm's CUDA kernels can run for an engine, and the kernel decisions the model's layers are handed.

The engine's ExecutionPlan (minillm/runner/plan.py) asks load_cuda_kernels once and decides every path from the
answer and the kernel families' coverage; the model only ever sees a ModelKernels. Nothing else decides: no
process-wide switch, no environment read (the two documented aliases are folded into the config by
minillm/config.py).

kernels.backend:
  auto   minillm's CUDA kernels on a GPU when the extension builds and loads; otherwise the torch path, and on a
         GPU one prominent message says why and how to fix it.
  cuda   the CUDA kernels or a configuration error (exit 2 from the CLI).
  torch  no minillm kernel at all: every op is plain torch (cuBLAS, SDPA-free gather attention).
runtime.attention picks the attention backend; auto follows the kernels, and torch with kernels auto means the
whole torch path (attention alone on torch while the other kernels run needs kernels.backend=cuda).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from minillm.config import ConfigError, EngineConfig


@dataclass(frozen=True)
class ModelKernels:
    """What the model's layers run: the fused CUDA kernels (norms, RoPE, SwiGLU) or their torch twins, and which
    linear layers (by role: qkv_proj, o_proj, gate_up_proj, down_proj) take the skinny GEMM at decode sizes, and
    which take the decode GEMM up to how many rows (it goes first). The default is plain torch (a model built
    outside an engine)."""
    cuda: bool = False
    skinny: frozenset[str] = field(default_factory=frozenset)
    decode_gemm: frozenset[tuple[str, int]] = field(default_factory=frozenset)   # (layer, max rows)
    moe_rows: int = 0   # mixture-of-experts steps of up to this many tokens take the fused MoE kernels; 0: never

    def skinny_for(self, layer: str) -> bool:
        return layer in self.skinny

    def decode_rows_for(self, layer: str) -> int:
        """The most rows this layer's products run on the decode GEMM; 0: never."""
        return max((rows for name, rows in self.decode_gemm if name == layer), default=0)


@dataclass(frozen=True)
class KernelLoad:
    """The answer of load_cuda_kernels: loaded or not, why, and the build error when the build failed."""
    loaded: bool
    reason: str
    unavailable: str | None = None


def load_cuda_kernels(cfg: EngineConfig, device_type: str) -> KernelLoad:
    """Load the CUDA extension where the config lets the kernels run on this device type ("cuda", "cpu")."""
    k, rt = cfg.kernels, cfg.runtime
    if k.backend == "torch":
        return KernelLoad(False, "kernels.backend=torch")
    if k.backend == "auto" and rt.attention == "torch":
        return KernelLoad(False, "runtime.attention=torch with kernels.backend=auto (the whole torch path)")
    if device_type != "cuda":
        if k.backend == "cuda" or rt.attention == "cuda":
            raise ConfigError(f"kernels.backend={k.backend!r} / runtime.attention={rt.attention!r} need a CUDA "
                              f"device, but the engine runs on {device_type}: use auto or torch")
        return KernelLoad(False, f"the engine runs on {device_type}")
    from minillm.ops.build import ExtensionError, load_extension

    try:
        load_extension()
    except ExtensionError as e:
        if k.backend == "cuda" or rt.attention == "cuda":
            raise ConfigError(f"kernels.backend=cuda: the CUDA kernels are unavailable: {e}") from None
        _warn_once(str(e))
        return KernelLoad(False, f"the CUDA kernels are unavailable: {e}", str(e))
    return KernelLoad(True, "minillm's CUDA kernels are loaded")


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    bar = "=" * 78
    print(f"{bar}\nminillm: warning: the CUDA kernels are unavailable, so this engine runs the plain torch path, "
          f"about 30x slower on a GPU.\n  cause: {reason}\n  fix: see the cause above; set kernels.backend=torch "
          f"to choose the torch path quietly, or kernels.backend=cuda to make this an error.\n{bar}",
          file=sys.stderr, flush=True)
