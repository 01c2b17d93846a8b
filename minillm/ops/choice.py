"""Which kernels an engine runs: resolved once from the config (kernels.*, runtime.attention*) into a KernelChoice
that the model, the attention backend and the sampler receive. Nothing else decides: no process-wide switch,
no environment read (the two documented aliases are folded into the config by minillm/config.py).

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
from dataclasses import asdict, dataclass

from minillm.config import ConfigError, EngineConfig, KernelConfig


@dataclass(frozen=True)
class KernelChoice:
    cuda: bool                    # minillm's CUDA kernels run (norms, RoPE, SwiGLU, sampler, GEMM, KV write)
    attention: str                # "cuda" | "torch": the attention backend
    attention_mode: str           # "split" | "unified" (CUDA attention only)
    skinny_gemm: bool             # decode-sized linear layers on the skinny GEMM (where it applies)
    decode_min_partitions: int
    decode_ctas_per_sm: int
    megakernel_max_batch: int = 0    # decode steps up to this many rows run the persistent kernel (0 = never) ...
    megakernel_max_tokens: int = 0   # ... when their contexts total at most this many tokens
    megakernel_min_chunks: int = 8
    pdl: bool = False                # kernels launched with programmatic dependent launch (minillm/ops/launch.py)
    unavailable: str | None = None   # why the CUDA kernels do not run although kernels.backend allowed them

    @classmethod
    def torch_only(cls) -> "KernelChoice":
        """Everything in plain torch (the CPU path, and tests' references). The decode split values are the
        config's defaults (unused by the torch path, but recorded on results lines)."""
        k = KernelConfig()
        return cls(cuda=False, attention="torch", attention_mode="split", skinny_gemm=False,
                   decode_min_partitions=k.decode_min_partitions, decode_ctas_per_sm=k.decode_ctas_per_sm)

    def record(self) -> dict:
        """The fields every results line carries."""
        d = asdict(self)
        d["cuda_ops"] = d.pop("cuda")
        return d


def resolve_kernels(cfg: EngineConfig, device) -> KernelChoice:
    """Decide the engine's kernels for `device` (a torch.device). Builds the extension when CUDA kernels may run."""
    k, rt = cfg.kernels, cfg.runtime
    backend = k.backend
    if backend == "auto" and rt.attention == "torch":
        backend = "torch"
    if backend == "torch":
        return KernelChoice.torch_only()
    if device.type != "cuda":
        if backend == "cuda" or rt.attention == "cuda":
            raise ConfigError(f"kernels.backend={k.backend!r} / runtime.attention={rt.attention!r} need a CUDA "
                              f"device, but the engine runs on {device}: use auto or torch")
        return KernelChoice.torch_only()
    from minillm.ops.build import ExtensionError, load_extension

    try:
        load_extension()
    except ExtensionError as e:
        if backend == "cuda" or rt.attention == "cuda":
            raise ConfigError(f"kernels.backend=cuda: the CUDA kernels are unavailable: {e}") from None
        _warn_once(str(e))
        return KernelChoice(**{**asdict(KernelChoice.torch_only()), "unavailable": str(e)})
    attention = "torch" if rt.attention == "torch" else "cuda"
    return KernelChoice(cuda=True, attention=attention, attention_mode=rt.attention_mode, skinny_gemm=k.skinny_gemm,
                        decode_min_partitions=k.decode_min_partitions, decode_ctas_per_sm=k.decode_ctas_per_sm,
                        megakernel_max_batch=k.megakernel_max_batch if k.megakernel and attention == "cuda" else 0,
                        megakernel_max_tokens=k.megakernel_max_tokens, megakernel_min_chunks=k.megakernel_min_chunks,
                        pdl=k.pdl and _pdl_supported(device))


def _pdl_supported(device) -> bool:
    from minillm.ops.launch import pdl_supported

    return pdl_supported(device)


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
