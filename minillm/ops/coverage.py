"""What a kernel family covers, declared once next to the family's wrapper and read by the execution plan
(minillm/runner/plan.py), which decides at engine start which path every step takes.

A family's KernelCoverage lists the dtypes, head dims, GQA groups, cache block sizes and GPU generations its
launchers accept, and whether its launches may be captured in a CUDA graph. The C++ launchers keep their own
checks (a defensive TORCH_CHECK or cudaErrorInvalidValue); tests/test_plan.py reads them from the sources and
fails when a declaration and its launcher disagree, and its GPU tests run every declared case.

Adding a kernel family: write its KernelCoverage (and, for limits no field here expresses, a small function
returning a reason or None) next to its ops wrapper, then add one entry to ExecutionPlan that asks it (the recipe
is in minillm/runner/plan.py). A quantised KV cache is a kv_dtypes entry of the families that read the cache.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelCoverage:
    family: str
    dtypes: tuple[str, ...]                      # activation dtypes, torch names without "torch."
    head_dims: tuple[int, ...] | None = None     # None: any the model has
    block_sizes: tuple[int, ...] | None = None   # KV-cache block sizes; None: the family reads no cache
    max_gqa_group: int | None = None             # query heads per KV head; None: any
    min_capability: tuple[int, int] = (8, 0)     # the oldest GPU generation (sm_80 is the build's floor)
    # The newest major generation; None: any, through the sm_80 PTX the driver compiles. A family whose body is
    # compiled for sm_90a only (guarded by __CUDA_ARCH__ >= 900) has an empty body in that PTX: 9.
    max_major: int | None = None
    graph_safe: bool = True                      # no host sync and no data-dependent allocation per launch
    kv_dtypes: tuple[str, ...] = ()              # quantised cache dtypes read besides the activation dtype

    def reason(self, *, dtype: str, capability: tuple[int, int], head_dim: int | None = None,
               num_q_heads: int | None = None, num_kv_heads: int | None = None, block_size: int | None = None,
               kv_dtype: str | None = None) -> str | None:
        """Why this family does not cover the case, or None when it does. Arguments left None are not asked."""
        gpu = f"the GPU is sm_{capability[0]}{capability[1]}"
        lo = f"sm_{self.min_capability[0]}{self.min_capability[1]}"
        if self.max_major is not None and (tuple(capability) < self.min_capability or capability[0] > self.max_major):
            return f"needs {lo} to sm_{self.max_major}x (machine code for sm_{self.max_major}0a only), {gpu}"
        if tuple(capability) < self.min_capability:
            return f"needs {lo} or newer, {gpu}"
        if dtype not in self.dtypes:
            return f"dtype {dtype} (covered: {', '.join(self.dtypes)})"
        if kv_dtype is not None and kv_dtype not in (dtype, *self.kv_dtypes):
            return f"KV-cache dtype {kv_dtype} with dtype {dtype} (covered: {', '.join((dtype, *self.kv_dtypes))})"
        if head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            return f"head_dim={head_dim} (covered: {', '.join(map(str, self.head_dims))})"
        if block_size is not None and self.block_sizes is not None and block_size not in self.block_sizes:
            return f"block_size={block_size} (covered: {', '.join(map(str, self.block_sizes))})"
        if num_q_heads is not None and num_kv_heads is not None and self.max_gqa_group is not None:
            if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= self.max_gqa_group:
                return (f"{num_q_heads} query heads over {num_kv_heads} KV heads (the group must be "
                        f"1..{self.max_gqa_group})")
        return None
