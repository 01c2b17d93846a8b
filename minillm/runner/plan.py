"""ExecutionPlan: which code path every step of an engine takes, decided once at engine start from the config, the
model's architecture, the KV-cache spec, the dtype and the device, and recorded on every results line.

Each path has a verdict (on or off) and a reason a person can read:
  fused_ops       the fused norms, RoPE, SwiGLU and the one-pass sampler (or their torch twins)
  attention       the CUDA paged-attention kernels (or the torch backend); prefill_kernel names the prefill kernel
                  that covers the cache and GPU (attention_ops.prefill_kernel: "wgmma" on sm_90, "wide" elsewhere,
                  "narrow" for an fp8 cache)
  fused_kv_write  k/v stored into the cache by the RoPE kernel (or by a separate KV write)
  prefill_sdpa    prefill sequences that are a whole prompt in one chunk, of at least min_tokens tokens, on cuDNN's
                  fused attention instead of the prefill kernel (attention_ops.PREFILL_SDPA_COVERAGE,
                  kernels.prefill_sdpa, kernels.prefill_sdpa_min_tokens); the backend splits a step's rows by it
  prefill_sdpa_prefix  prefill chunks over a cached prefix of at least min_tokens queries on cuDNN too, over K/V
                  read back from the cache (attention_ops.prefill_cudnn, cudnn_attention_available;
                  kernels.prefill_sdpa_prefix, kernels.prefill_sdpa_prefix_min_tokens)
  skinny_gemm     per linear layer (qkv_proj, o_proj, gate_up_proj, down_proj): the skinny GEMM for decode-sized
                  products (or cuBLAS); the row count is the only question left for the call
  decode_gemm     per linear layer: the decode GEMM up to its measured-win row count (minillm/ops/decode_gemm.py
                  MEASURED_WINS and covers()); it goes before the skinny GEMM, which goes before cuBLAS
  megakernel      decode steps of up to megakernel_rows rows and megakernel_max_tokens context tokens in one
                  persistent kernel
  moe             mixture-of-experts steps of up to max_rows tokens on minillm's fused routing and grouped expert
                  kernels (moe_ops.FUSED_COVERAGE, fused_shape_reason); longer steps take torch._grouped_mm, or
                  the host-synced expert loop where grouped_mm cannot run
  cuda_graphs     decode-only steps replay captured graphs; on only where every kernel on the decode path is
                  graph-safe, so a capture can never meet a host sync
  pdl             minillm's kernels launched with programmatic dependent launch

What a kernel family covers is declared once, next to its ops wrapper (a KernelCoverage, minillm/ops/coverage.py,
plus a shape function where a family has limits of its own): attention_ops.COVERAGE, fused_ops.COVERAGE,
gemm_ops.COVERAGE, megakernel.COVERAGE, and the torch attention backend's. The plan only asks them.

Adding a kernel family (an fp8 KV cache, which is attention's kv_dtypes; decode_gemm is an example): declare its
KernelCoverage next to its wrapper, add one Verdict field to ExecutionPlan (and its name to PATHS) and one _Case
method that asks the declaration; if it runs on the decode path, add it to cuda_graphs()'s graph-safety list. Hand
the verdict to the layer that calls the family (ModelKernels for the model's layers). The record and the log
line pick the new path up from PATHS.

Under kernels.backend=cuda (or runtime.attention=cuda) a model or cache the attention or fused kernels do not
cover is a ConfigError naming the key, before anything is allocated; under auto that path runs on torch and the
engine says so once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from minillm.attention import torch_backend
from minillm.config import ConfigError, EngineConfig
from minillm.ops import attention_ops, fused_ops, gemm_ops
from minillm.ops import decode_gemm as dg
from minillm.ops import megakernel as mk
from minillm.ops import moe_ops
from minillm.ops.choice import KernelLoad, ModelKernels, load_cuda_kernels

LINEAR_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PATHS = ("fused_ops", "attention", "fused_kv_write", "megakernel", "cuda_graphs", "pdl", "prefill_sdpa",
         "prefill_sdpa_prefix")


@dataclass(frozen=True)
class DeviceInfo:
    """The device facts the plan reads, as plain values (tests pass a made-up sm_90 GPU)."""
    type: str                              # "cuda" | "cpu"
    capability: tuple[int, int] = (0, 0)
    num_sms: int = 0
    smem_per_block_optin: int = 0

    @classmethod
    def of(cls, device: torch.device) -> "DeviceInfo":
        if device.type != "cuda":
            return cls(device.type)
        p = torch.cuda.get_device_properties(device)
        return cls("cuda", (p.major, p.minor), p.multi_processor_count,
                   getattr(p, "shared_memory_per_block_optin", mk.DEFAULT_SMEM_LIMIT))

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.type == "cuda" else self.type


@dataclass(frozen=True)
class Verdict:
    on: bool
    reason: str

    def record(self) -> dict:
        return {"on": self.on, "reason": self.reason}


@dataclass(frozen=True)
class RowsVerdict(Verdict):
    """A per-layer verdict with the most rows a call may have to take the path (0 when off)."""
    max_rows: int = 0

    def record(self) -> dict:
        return {**super().record(), "max_rows": self.max_rows}


@dataclass(frozen=True)
class TokensVerdict(Verdict):
    """A verdict on sequences of at least min_tokens tokens (0 when off)."""
    min_tokens: int = 0

    def record(self) -> dict:
        return {**super().record(), "min_tokens": self.min_tokens}


def _all_off(reason: str) -> dict[str, RowsVerdict]:
    return {n: RowsVerdict(False, reason) for n in LINEAR_LAYERS}


@dataclass(frozen=True)
class ExecutionPlan:
    fused_ops: Verdict
    attention: Verdict
    fused_kv_write: Verdict
    skinny_gemm: dict[str, Verdict]
    megakernel: Verdict
    cuda_graphs: Verdict
    pdl: Verdict
    attention_mode: str = "split"
    decode_min_partitions: int = 1
    decode_ctas_per_sm: int = 2
    megakernel_rows: int = 0
    megakernel_max_tokens: int = 0
    megakernel_min_chunks: int = 8
    unavailable: str | None = None         # the build error, when kernels.backend=auto fell back to torch
    notices: tuple[str, ...] = field(default=(), compare=False)   # said once at engine start
    decode_gemm: dict[str, RowsVerdict] = field(default_factory=lambda: _all_off("plain torch"))
    moe: RowsVerdict = RowsVerdict(False, "plain torch")
    prefill_kernel: str | None = None      # the CUDA prefill kernel (attention_ops.PREFILL_KERNELS); None: torch
    prefill_sdpa: TokensVerdict = TokensVerdict(False, "plain torch")
    prefill_sdpa_prefix: TokensVerdict = TokensVerdict(False, "plain torch")

    # ---- what the runner and the model ask ----
    @property
    def attention_backend(self) -> str:
        return "cuda" if self.attention.on else "torch"

    @property
    def prefill_sdpa_min_tokens(self) -> int:
        """The attention backend's threshold for whole prompts on SDPA; 0: every prefill row on the kernel."""
        return self.prefill_sdpa.min_tokens if self.prefill_sdpa.on else 0

    @property
    def prefill_prefix_min_tokens(self) -> int:
        """The threshold for chunks over a prefix on cuDNN; 0: those chunks on the kernel."""
        return self.prefill_sdpa_prefix.min_tokens if self.prefill_sdpa_prefix.on else 0

    def model_kernels(self) -> ModelKernels:
        return ModelKernels(cuda=self.fused_ops.on,
                            skinny=frozenset(name for name, v in self.skinny_gemm.items() if v.on),
                            decode_gemm=frozenset((n, v.max_rows) for n, v in self.decode_gemm.items() if v.on),
                            moe_rows=self.moe.max_rows if self.moe.on else 0)

    def step_path(self, decode_only: bool, seq_lens: list[int]) -> str:
        """How a step of these rows (context lengths seq_lens) runs: "megakernel", "graph" or "eager"."""
        if not decode_only or not self.cuda_graphs.on:
            return "eager"
        if self.megakernel.on and len(seq_lens) <= self.megakernel_rows \
                and sum(seq_lens) <= self.megakernel_max_tokens:
            return "megakernel"
        return "graph"

    def without_graphs(self, reason: str) -> "ExecutionPlan":
        """The plan after a failed capture (the runner then serves eagerly): the record says what ran."""
        off = Verdict(False, reason)
        return dataclasses.replace(self, cuda_graphs=off, megakernel=off, notices=())

    # ---- what results lines and the log say ----
    def record(self) -> dict:
        """Every results line carries this: the keys of the former KernelChoice record (plots and readers use
        them) plus each path's verdict and reason."""
        return {"cuda_ops": self.fused_ops.on, "attention": self.attention_backend,
                "attention_mode": self.attention_mode, "skinny_gemm": any(v.on for v in self.skinny_gemm.values()),
                "decode_gemm": any(v.on for v in self.decode_gemm.values()),
                "decode_min_partitions": self.decode_min_partitions, "decode_ctas_per_sm": self.decode_ctas_per_sm,
                "megakernel_max_batch": self.megakernel_rows if self.megakernel.on else 0,
                "megakernel_max_tokens": self.megakernel_max_tokens,
                "megakernel_min_chunks": self.megakernel_min_chunks, "pdl": self.pdl.on,
                "unavailable": self.unavailable, "cuda_graphs": self.cuda_graphs.on,
                "plan": {**{p: getattr(self, p).record() for p in PATHS},
                         "skinny_gemm": {n: v.record() for n, v in self.skinny_gemm.items()},
                         "decode_gemm": {n: v.record() for n, v in self.decode_gemm.items()},
                         "moe": self.moe.record(), "prefill_kernel": self.prefill_kernel}}

    def describe(self) -> str:
        """One line: every path's verdict."""
        parts = [f"{p}={'on' if getattr(self, p).on else 'off'}" for p in PATHS]
        skinny = [n for n, v in self.skinny_gemm.items() if v.on]
        decode = [n for n, v in self.decode_gemm.items() if v.on]
        parts.insert(3, f"skinny_gemm={','.join(skinny) or 'off'}")
        parts.insert(3, f"decode_gemm={','.join(decode) or 'off'}")
        if self.moe.on:
            parts.insert(3, f"moe<={self.moe.max_rows}")
        if self.prefill_kernel is not None:
            parts.insert(2, f"prefill={self.prefill_kernel}")
        return "execution plan: " + " ".join(parts)


def resolve_plan(cfg: EngineConfig, arch, kv_spec, dtype: torch.dtype, device: DeviceInfo,
                 load=load_cuda_kernels) -> ExecutionPlan:
    """The plan of an engine. arch: ModelArchConfig; kv_spec: KVCacheSpec. `load(cfg, device_type)` loads the
    CUDA extension (tests pass a stand-in). Raises ConfigError for what kernels.backend=cuda cannot serve."""
    loaded = load(cfg, device.type)
    case = _Case(cfg, arch, kv_spec, _name(dtype), device, loaded)
    fused = case.fused_ops()
    attention = case.attention()
    decode = case.decode_gemm(dtype)
    moe = case.moe()
    graphs = case.cuda_graphs(fused, attention, dtype, moe,
                              gemms=[dg.COVERAGE] * any(v.on for v in decode.values()))
    megakernel = case.megakernel(dtype, attention, graphs)
    sdpa = case.prefill_sdpa(attention)
    k = cfg.kernels
    return ExecutionPlan(
        fused_ops=fused, attention=attention, fused_kv_write=_fused_kv_write(fused, attention),
        skinny_gemm=case.skinny_gemm(), megakernel=megakernel, cuda_graphs=graphs, pdl=case.pdl(),
        attention_mode=cfg.runtime.attention_mode, decode_min_partitions=k.decode_min_partitions,
        decode_ctas_per_sm=k.decode_ctas_per_sm, megakernel_rows=case.megakernel_rows(),
        megakernel_max_tokens=k.megakernel_max_tokens, megakernel_min_chunks=k.megakernel_min_chunks,
        unavailable=loaded.unavailable, notices=_notices(device, attention, graphs), decode_gemm=decode, moe=moe,
        prefill_kernel=_prefill_kernel(attention, kv_spec, dtype, device), prefill_sdpa=sdpa,
        prefill_sdpa_prefix=case.prefill_sdpa_prefix(sdpa))


def _prefill_kernel(attention: Verdict, kv_spec, dtype: torch.dtype, device: DeviceInfo) -> str | None:
    """Which CUDA prefill kernel covers this cache on this GPU (attention_ops.prefill_kernel), when attention runs
    on CUDA."""
    if not attention.on:
        return None
    return attention_ops.prefill_kernel(_name(dtype), _name(kv_spec.dtype), kv_spec.head_dim,
                                        tuple(device.capability))


def torch_plan(cfg: EngineConfig | None = None) -> ExecutionPlan:
    """Everything on plain torch, eager (a model or sampler used outside an engine, and tests' references)."""
    from minillm.config import KernelConfig

    k = (cfg.kernels if cfg is not None else KernelConfig())
    off = Verdict(False, "plain torch")
    return ExecutionPlan(off, off, off, {n: off for n in LINEAR_LAYERS}, off, off, off,
                         decode_min_partitions=k.decode_min_partitions, decode_ctas_per_sm=k.decode_ctas_per_sm,
                         megakernel_max_tokens=k.megakernel_max_tokens, megakernel_min_chunks=k.megakernel_min_chunks)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config_key(reason: str) -> str:
    """The config key a coverage reason is about (for the ConfigError under kernels.backend=cuda)."""
    for prefix, key in (("dtype", "model.dtype"), ("KV-cache dtype", "cache.kv_cache_dtype"),
                        ("block_size", "cache.block_size"), ("needs sm", "runtime.device")):
        if reason.startswith(prefix):
            return key
    return "model.model"


@dataclass
class _Case:
    cfg: EngineConfig
    arch: object
    kv_spec: object
    dtype: str
    device: DeviceInfo
    loaded: KernelLoad

    def _required(self, what: str, reason: str) -> None:
        """Under kernels.backend=cuda / runtime.attention=cuda an uncovered required family is a config error."""
        k, rt = self.cfg.kernels, self.cfg.runtime
        forced = "kernels.backend=cuda" if k.backend == "cuda" else \
            "runtime.attention=cuda" if rt.attention == "cuda" and what == "attention" else None
        if forced is not None:
            raise ConfigError(f"{_config_key(reason)}: {forced} is not allowed here, the CUDA {what} kernels do "
                              f"not cover {reason}; use kernels.backend=auto (that path then runs on torch) or a "
                              "covered setting")

    def fused_ops(self) -> Verdict:
        if not self.loaded.loaded:
            return Verdict(False, self.loaded.reason)
        a = self.arch
        reason = fused_ops.COVERAGE.reason(dtype=self.dtype, capability=self.device.capability) or \
            fused_ops.shape_reason(a.hidden_size, a.head_dim, a.vocab_size)
        if reason is not None:
            self._required("fused", reason)
            return Verdict(False, f"the fused kernels do not cover {reason}")
        return Verdict(True, "CUDA norms, RoPE, SwiGLU and sampler")

    def attention(self) -> Verdict:
        if self.cfg.runtime.attention == "torch":
            return Verdict(False, "runtime.attention=torch")
        if not self.loaded.loaded:
            return Verdict(False, self.loaded.reason)
        a, spec = self.arch, self.kv_spec
        reason = attention_ops.COVERAGE.reason(
            dtype=self.dtype, capability=self.device.capability, head_dim=a.head_dim, num_q_heads=a.num_attention_heads,
            num_kv_heads=a.num_key_value_heads, block_size=spec.block_size, kv_dtype=_name(spec.dtype))
        if reason is not None:
            self._required("attention", reason)
            return Verdict(False, f"the CUDA attention kernels do not cover {reason}")
        return Verdict(True, f"CUDA paged attention ({self.cfg.runtime.attention_mode})")

    def prefill_sdpa(self, attention: Verdict) -> TokensVerdict:
        """Whole prompts on SDPA: it stands in for the CUDA prefill kernel on native caches, in split mode."""
        k, a, spec = self.cfg.kernels, self.arch, self.kv_spec
        if not k.prefill_sdpa:
            return TokensVerdict(False, "kernels.prefill_sdpa=false")
        if not attention.on:
            return TokensVerdict(False, f"it stands in for the CUDA prefill kernel, which is off ({attention.reason})")
        if self.cfg.runtime.attention_mode != "split":
            return TokensVerdict(False, "runtime.attention_mode=unified sends every row through the prefill kernel")
        if spec.quantized:
            return TokensVerdict(False, f"the {self.cfg.cache.kv_cache_dtype} cache: later chunks and decode steps "
                                        "read the quantized k/v, so the prompt's own rows read them too (narrow "
                                        "kernel)")
        reason = attention_ops.PREFILL_SDPA_COVERAGE.reason(dtype=self.dtype, capability=self.device.capability,
                                                            head_dim=a.head_dim, kv_dtype=_name(spec.dtype))
        if reason is not None:
            return TokensVerdict(False, f"cuDNN attention is not declared for {reason}")
        if not attention_ops.cudnn_attention_available():
            return TokensVerdict(False, "this torch build has no cuDNN attention "
                                        "(aten::_scaled_dot_product_cudnn_attention)")
        n = k.prefill_sdpa_min_tokens
        prefix = "cuDNN" if k.prefill_sdpa_prefix else "the prefill kernel (kernels.prefill_sdpa_prefix=false)"
        return TokensVerdict(True, f"whole prompts of >= {n} tokens in one chunk on cuDNN attention; chunks over a "
                                   f"prefix on {prefix}; shorter ones on the prefill kernel", n)

    def prefill_sdpa_prefix(self, sdpa: TokensVerdict) -> TokensVerdict:
        """Chunks over a prefix on cuDNN: where whole prompts take it (the same dtypes, caches, mode and torch
        build), and kernels.prefill_sdpa_prefix leaves it on."""
        if not sdpa.on:
            return TokensVerdict(False, f"it goes with whole prompts on cuDNN, which is off ({sdpa.reason})")
        if not self.cfg.kernels.prefill_sdpa_prefix:
            return TokensVerdict(False, "kernels.prefill_sdpa_prefix=false")
        n = self.cfg.kernels.prefill_sdpa_prefix_min_tokens
        return TokensVerdict(True, f"prefill chunks over a cached prefix of >= {n} queries on cuDNN attention, over "
                                   "K/V read back from the cache, one call per chunk", n)

    def skinny_gemm(self) -> dict[str, Verdict]:
        if not self.cfg.kernels.skinny_gemm:
            return {n: Verdict(False, "kernels.skinny_gemm=false") for n in LINEAR_LAYERS}
        if not self.loaded.loaded:
            return {n: Verdict(False, self.loaded.reason) for n in LINEAR_LAYERS}
        reason = gemm_ops.COVERAGE.reason(dtype=self.dtype, capability=self.device.capability)
        if reason is not None:
            return {n: Verdict(False, reason) for n in LINEAR_LAYERS}
        out = {}
        for name, (n, k, bias) in linear_shapes(self.arch).items():
            why = gemm_ops.shape_reason(n, k, bias)
            out[name] = Verdict(why is None, why or f"[{n}, {k}] at up to {gemm_ops.MAX_ROWS} rows")
        return out

    def decode_gemm(self, dtype: torch.dtype) -> dict[str, RowsVerdict]:
        """Per layer: the decode GEMM where covers() takes the shape and MEASURED_WINS says it beat cuBLAS and the
        skinny GEMM, up to the row count it won at."""
        if not self.cfg.kernels.decode_gemm:
            return _all_off("kernels.decode_gemm=false")
        if not self.loaded.loaded:
            return _all_off(self.loaded.reason)
        reason = dg.COVERAGE.reason(dtype=self.dtype, capability=self.device.capability)
        if reason is not None:
            return _all_off(reason)
        out = {}
        for name, (n, k, bias) in linear_shapes(self.arch).items():
            rows, why = dg.layer_rows(n, k, bias, dtype, self.device.capability[0])
            out[name] = RowsVerdict(rows > 0, why, rows)
        return out

    def moe(self) -> RowsVerdict:
        """The fused MoE kernels for steps of up to FUSED_MAX_TOKENS tokens, where they cover the model."""
        a = self.arch
        if not getattr(a, "num_experts", 0):
            return RowsVerdict(False, "the model has no mixture-of-experts layers")
        if not self.cfg.kernels.moe:
            return RowsVerdict(False, "kernels.moe=false")
        if not self.loaded.loaded:
            return RowsVerdict(False, self.loaded.reason)
        reason = moe_ops.FUSED_COVERAGE.reason(dtype=self.dtype, capability=self.device.capability) or \
            moe_ops.fused_shape_reason(a.num_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size)
        if reason is not None:
            return RowsVerdict(False, f"the fused MoE kernels do not cover {reason}")
        rows = moe_ops.FUSED_MAX_TOKENS
        return RowsVerdict(True, f"fused routing and expert GEMMs for steps of up to {rows} tokens", rows)

    def megakernel_rows(self) -> int:
        return min(self.cfg.kernels.megakernel_max_batch, self.cfg.scheduler.max_num_seqs)

    def megakernel(self, dtype: torch.dtype, attention: Verdict, graphs: Verdict) -> Verdict:
        k = self.cfg.kernels
        if not k.megakernel:
            return Verdict(False, "kernels.megakernel=false")
        if not attention.on:
            return Verdict(False, f"it stands in for the CUDA attention path, which is off ({attention.reason})")
        if not graphs.on:
            return Verdict(False, f"it runs under CUDA graphs only, which are off ({graphs.reason})")
        if self.kv_spec.quantized:   # ops/kv_quant.py FP8_KERNEL_COVERAGE["decode_megakernel"]
            return Verdict(False, f"it reads bf16/fp16 caches only, not {self.cfg.cache.kv_cache_dtype}")
        d = self.device
        reason = mk.unsupported_reason(self.arch, dtype, self.kv_spec.block_size, self.megakernel_rows(),
                                       num_ctas=d.num_sms, smem_limit=d.smem_per_block_optin, capability=d.capability)
        if reason is not None:
            return Verdict(False, f"the persistent kernel does not cover {reason}")
        return Verdict(True, f"decode steps of 1..{self.megakernel_rows()} rows, <= {k.megakernel_max_tokens} tokens")

    def cuda_graphs(self, fused: Verdict, attention: Verdict, dtype: torch.dtype, moe: RowsVerdict,
                    gemms=()) -> Verdict:
        if self.device.type != "cuda":
            return Verdict(False, f"the engine runs on {self.device.type}")
        if self.cfg.runtime.enforce_eager:
            return Verdict(False, "runtime.enforce_eager=true")
        if getattr(self.arch, "num_experts", 0):
            a = self.arch
            why = moe_ops.grouped_mm_coverage_reason(self.device.type, self.device.capability, dtype,
                                                     a.hidden_size, a.moe_intermediate_size)
            # Captured steps have up to max_num_seqs tokens: the fused kernels take them all, or grouped_mm must.
            if why is not None and not (moe.on and self.cfg.scheduler.max_num_seqs <= moe.max_rows):
                return Verdict(False, f"the mixture-of-experts layers sync with the host ({why})")
        # Every family on the decode path must be graph-safe; the torch twins of the fused ops are plain tensor ops.
        if not attention.on and not torch_backend.COVERAGE.graph_safe:
            return Verdict(False, torch_backend.NOT_GRAPH_SAFE)
        families = [attention_ops.COVERAGE] * attention.on + [fused_ops.COVERAGE] * fused.on + list(gemms) + \
            [moe_ops.FUSED_COVERAGE] * moe.on
        unsafe = [c.family for c in families if not c.graph_safe]
        if unsafe:
            return Verdict(False, f"{', '.join(unsafe)} is not graph-safe")
        return Verdict(True, "decode-only steps replay captured graphs")

    def pdl(self) -> Verdict:
        if not self.loaded.loaded:
            return Verdict(False, self.loaded.reason)
        if not self.cfg.kernels.pdl:
            return Verdict(False, "kernels.pdl=false")
        if self.device.capability < (9, 0):
            return Verdict(False, f"needs sm_90 or newer, the GPU is {self.device.sm}")
        return Verdict(True, "minillm's kernels launch with programmatic dependent launch")


def _fused_kv_write(fused: Verdict, attention: Verdict) -> Verdict:
    if not attention.on:
        return Verdict(False, "the torch attention path writes the cache itself")
    if not fused.on:
        return Verdict(False, f"the RoPE kernel does not run ({fused.reason})")
    return Verdict(True, "RoPE kernel stores k/v into the cache")


def linear_shapes(arch) -> dict[str, tuple[int, int, bool]]:
    """(N, K, has bias) of each linear layer role of a Qwen decoder layer."""
    h, i = arch.hidden_size, arch.intermediate_size
    return {"qkv_proj": (arch.q_size + 2 * arch.kv_size, h, arch.qkv_bias), "o_proj": (h, arch.q_size, False),
            "gate_up_proj": (2 * i, h, False), "down_proj": (h, i, False)}


def _notices(device: DeviceInfo, attention: Verdict, graphs: Verdict) -> tuple[str, ...]:
    """What the engine says once at start: a GPU path that runs slower than the defaults would, and why."""
    if device.type != "cuda":
        return ()
    torch_attention = f"attention runs on the torch path ({attention.reason})"
    if not graphs.on and not graphs.reason.startswith("runtime.enforce_eager"):
        lead = f"{torch_attention}, so decode" if not attention.on else "decode"
        return (f"{lead} runs eagerly, without CUDA graphs: {graphs.reason}",)
    if not attention.on and "do not cover" in attention.reason:
        return (torch_attention,)
    return ()
