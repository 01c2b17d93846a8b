"""Engine configuration: one frozen dataclass per section, validated with messages that name the key.

The YAML layer (configs/*.yaml, --set overrides) lives in minillm/config_loader.py and produces these.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key, the value and what is allowed."""


def _check(cond: bool, key: str, value, allowed: str) -> None:
    if not cond:
        from minillm.untrusted import short_repr   # a huge value must not make a huge message
        raise ConfigError(f"{key}={short_repr(value)} is not allowed: {allowed}")


def _is_int(v, low: int, high: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # HF directory, preset name (e.g. "qwen3-0.6b") or None = demo model
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16
    load_format: str = "auto"         # auto | safetensors | dummy
    max_model_len: int | None = None  # None = from the model's config (capped by max_position_embeddings)

    def validate(self) -> None:
        _check(self.model is None or (isinstance(self.model, str) and self.model.strip() != ""), "model.model",
               self.model, "a model directory, a preset name, demo, or null (the demo model)")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype", self.dtype,
               "one of auto, float32, bfloat16, float16")
        _check(self.load_format in ("auto", "safetensors", "dummy"), "model.load_format", self.load_format,
               "one of auto, safetensors, dummy")
        _check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
               "model.max_model_len", self.max_model_len, "an integer >= 2 or null")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None      # None = size from gpu_memory_utilization (GPU) or a CPU default
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"          # auto = the model dtype (an fp8 cache comes later)

    def validate(self) -> None:
        _check(self.block_size in (8, 16, 32, 64), "cache.block_size", self.block_size, "one of 8, 16, 32, 64")
        _check(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1),
               "cache.num_kv_blocks", self.num_kv_blocks, "an integer >= 1 or null")
        _check(isinstance(self.gpu_memory_utilization, (int, float)) and 0.05 <= self.gpu_memory_utilization <= 0.99,
               "cache.gpu_memory_utilization", self.gpu_memory_utilization, "a number in [0.05, 0.99]")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "cache.kv_cache_dtype", self.kv_cache_dtype,
               f"one of {', '.join(KV_CACHE_DTYPES)} (auto = the model dtype; an fp8 cache is not supported yet)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # 0 = no per-request chunk cap
    policy: str = "fcfs"                    # fcfs | priority | static

    def validate(self) -> None:
        _check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "scheduler.max_num_seqs",
               self.max_num_seqs, "an integer >= 1")
        _check(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
               "scheduler.max_num_batched_tokens", self.max_num_batched_tokens, "an integer >= 1")
        _check(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
               "scheduler.long_prefill_token_threshold", self.long_prefill_token_threshold, "an integer >= 0")
        _check(self.policy in ("fcfs", "priority", "static"), "scheduler.policy", self.policy,
               "one of fcfs, priority, static")


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    attention: str = "auto"           # auto (cuda kernels on a GPU, torch elsewhere) | cuda | torch
    attention_mode: str = "split"     # split (decode rows -> decode kernel) | unified (all -> prefill kernel)
    enforce_eager: bool = False       # True = no CUDA graphs
    seed: int = 0
    check_integrity: bool = False     # run KV-cache invariant checks after every step (tests / debugging)
    # Overlap the host work of step N+1 with the GPU work of step N (sampled tokens stay on the device and
    # feed the next step; stop checks land one step later). +16.5% offline throughput on an H200
    # (docs/perf-log.md); falls back to synchronous steps for requests with penalties.
    async_scheduling: bool = True

    def validate(self) -> None:
        _check(isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda") or (
            self.device.startswith("cuda:") and self.device[5:].isdigit())), "runtime.device", self.device,
            "auto, cpu, cuda or cuda:N")
        _check(self.attention in ("auto", "cuda", "torch"), "runtime.attention", self.attention,
               "one of auto, cuda, torch")
        _check(self.attention_mode in ("split", "unified"), "runtime.attention_mode", self.attention_mode,
               "one of split, unified")
        # The GPU sampler keys its noise on a 63-bit seed (and torch generators take no more).
        _check(_is_int(self.seed, 0, (1 << 63) - 1), "runtime.seed", self.seed, "an integer in [0, 2**63 - 1]")


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels run, and their tuning values. Resolved once per engine into a KernelChoice
    (minillm/ops/choice.py) that the model, the attention backend and the sampler receive."""
    backend: str = "auto"             # auto (minillm's CUDA kernels on a GPU when they build) | cuda | torch
    skinny_gemm: bool = True          # decode-sized linear layers on the skinny GEMM where it beats cuBLAS
    # Split-K of the decode attention kernel: cut every sequence into as many partitions as keep the grid within
    # decode_ctas_per_sm CTAs per SM, and at least decode_min_partitions (minillm/ops/attention_ops.py).
    decode_min_partitions: int = 1
    decode_ctas_per_sm: int = 2
    # Decode steps of up to megakernel_max_batch rows whose contexts total at most megakernel_max_tokens run all
    # decoder layers in one persistent kernel (minillm/ops/megakernel.py) where it covers the model and GPU
    # (sm_90): measured faster than the graph path at every B <= 16 and context <= 2048 (e8f4571; 16 x 2048 =
    # 32,768 tokens), longer steps are not measured (docs/megakernel.md). Its attention partitions are at least
    # megakernel_min_chunks x 16 tokens.
    megakernel: bool = True
    megakernel_max_batch: int = 16
    megakernel_max_tokens: int = 32768
    megakernel_min_chunks: int = 8
    # minillm's kernels launched with programmatic dependent launch (sm_90+, minillm/ops/launch.py): each may be
    # scheduled while the kernel before it finishes. Results are the same either way.
    pdl: bool = True

    def validate(self) -> None:
        _check(self.backend in ("auto", "cuda", "torch"), "kernels.backend", self.backend,
               "one of auto, cuda, torch")
        _check(isinstance(self.decode_min_partitions, int) and 1 <= self.decode_min_partitions <= 32,
               "kernels.decode_min_partitions", self.decode_min_partitions, "an integer in [1, 32]")
        _check(isinstance(self.decode_ctas_per_sm, int) and 1 <= self.decode_ctas_per_sm <= 64,
               "kernels.decode_ctas_per_sm", self.decode_ctas_per_sm, "an integer in [1, 64]")
        _check(isinstance(self.megakernel_max_batch, int) and 1 <= self.megakernel_max_batch <= 16,
               "kernels.megakernel_max_batch", self.megakernel_max_batch, "an integer in [1, 16]")
        _check(isinstance(self.megakernel_max_tokens, int) and self.megakernel_max_tokens >= 1,
               "kernels.megakernel_max_tokens", self.megakernel_max_tokens, "an integer >= 1")
        _check(isinstance(self.megakernel_min_chunks, int) and 1 <= self.megakernel_min_chunks <= 64,
               "kernels.megakernel_min_chunks", self.megakernel_min_chunks, "an integer in [1, 64]")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ParallelConfig:
    """Processes and devices: the engine core in a process of its own, data-parallel replicas of it, tensor
    parallelism inside each (docs/parallel.md)."""
    data_parallel_size: int = 1       # engine-core replicas behind one front end (replica i on cuda:i)
    tensor_parallel_size: int = 1     # ranks of one engine core (Megatron split over torch.distributed)
    # auto: a process of its own for the serving commands (serve, serve-stdin) and whenever
    # data_parallel_size > 1; in-process for LLM(...) and generate. true / false force it.
    engine_process: str | bool = "auto"
    # Seconds a collective may wait for a peer before the engine fails (a dead tensor-parallel worker).
    distributed_timeout_s: float = 60.0

    def validate(self) -> None:
        _check(_is_int(self.data_parallel_size, 1, 64), "parallel.data_parallel_size", self.data_parallel_size,
               "an integer in [1, 64]")
        _check(_is_int(self.tensor_parallel_size, 1, 64), "parallel.tensor_parallel_size",
               self.tensor_parallel_size, "an integer in [1, 64]")
        _check(self.engine_process in ("auto", True, False), "parallel.engine_process", self.engine_process,
               "auto, true or false")
        _check(isinstance(self.distributed_timeout_s, (int, float)) and not isinstance(
            self.distributed_timeout_s, bool) and 1 <= self.distributed_timeout_s <= 3600,
            "parallel.distributed_timeout_s", self.distributed_timeout_s, "a number of seconds in [1, 3600]")
        if self.data_parallel_size > 1 and self.engine_process is False:
            raise ConfigError("parallel.engine_process=false is not allowed with parallel.data_parallel_size > 1: "
                              "each replica is an engine-core process")

    def engine_in_process(self, serving: bool) -> bool:
        """The one place that decides whether the engine core runs in the caller's process."""
        if self.data_parallel_size > 1:
            return False
        if self.engine_process == "auto":
            return not serving
        return not self.engine_process


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "EngineConfig":
        for section in (self.model, self.cache, self.scheduler, self.runtime, self.kernels, self.parallel):
            section.validate()
        if self.kernels.backend == "torch" and self.runtime.attention == "cuda":
            raise ConfigError("runtime.attention='cuda' is not allowed with kernels.backend='torch' (no minillm "
                              "kernel runs then): use runtime.attention auto or torch, or kernels.backend auto")
        return self

    # LLM(...) keyword -> (section, field). Keeps the Python API flat like vLLM's while configs stay sectioned.
    KWARGS = {
        "dtype": ("model", "dtype"), "load_format": ("model", "load_format"),
        "max_model_len": ("model", "max_model_len"),
        "block_size": ("cache", "block_size"), "num_kv_blocks": ("cache", "num_kv_blocks"),
        "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
        "enable_prefix_caching": ("cache", "enable_prefix_caching"),
        "max_num_seqs": ("scheduler", "max_num_seqs"),
        "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
        "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
        "long_prefill_token_threshold": ("scheduler", "long_prefill_token_threshold"),
        "scheduling_policy": ("scheduler", "policy"),
        "device": ("runtime", "device"), "attention": ("runtime", "attention"),
        "attention_mode": ("runtime", "attention_mode"), "enforce_eager": ("runtime", "enforce_eager"),
        "seed": ("runtime", "seed"), "check_integrity": ("runtime", "check_integrity"),
        "async_scheduling": ("runtime", "async_scheduling"), "kv_cache_dtype": ("cache", "kv_cache_dtype"),
        "kernels": ("kernels", "backend"), "skinny_gemm": ("kernels", "skinny_gemm"),
        "decode_min_partitions": ("kernels", "decode_min_partitions"),
        "decode_ctas_per_sm": ("kernels", "decode_ctas_per_sm"), "megakernel": ("kernels", "megakernel"),
        "megakernel_max_batch": ("kernels", "megakernel_max_batch"),
        "megakernel_max_tokens": ("kernels", "megakernel_max_tokens"),
        "megakernel_min_chunks": ("kernels", "megakernel_min_chunks"), "pdl": ("kernels", "pdl"),
        "data_parallel_size": ("parallel", "data_parallel_size"),
        "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
        "engine_process": ("parallel", "engine_process"),
        "distributed_timeout_s": ("parallel", "distributed_timeout_s"),
    }

    @classmethod
    def from_kwargs(cls, model: str | None = None, base: "EngineConfig | None" = None, **kwargs) -> "EngineConfig":
        """LLM(...)'s keywords over `base` (default: the built-in defaults with the environment aliases)."""
        base = base or env_alias_config(cls())
        sections = {f.name: {} for f in dataclasses.fields(cls)}
        for key, value in kwargs.items():
            if key not in cls.KWARGS:
                raise ConfigError(f"unknown engine argument {key!r}; known: {', '.join(sorted(cls.KWARGS))}")
            section, name = cls.KWARGS[key]
            sections[section][name] = value
        if model is not None:
            sections["model"]["model"] = model
        cfg = cls(**{name: dataclasses.replace(getattr(base, name), **vals) for name, vals in sections.items()})
        return cfg.validate()


# The two switches of the seed documents, kept as aliases of config keys: the only behaviour the environment
# may change. Read here, in config loading, into the config; explicit settings (--set, flags, LLM keywords)
# win over them.
ENV_ALIASES = {
    "MINI_ENGINE_OPS": {"0": ("kernels", "backend", "torch"), "1": None},
    "MINI_ENGINE_ATTN": {"unified": ("runtime", "attention_mode", "unified"), "split": None},
}


def env_alias_values(environ=None) -> dict[str, dict[str, object]]:
    """{section: {key: value}} set by the environment aliases; an alias set to a value it does not know is an
    error naming the variable."""
    environ = os.environ if environ is None else environ
    out: dict[str, dict[str, object]] = {}
    for var, meanings in ENV_ALIASES.items():
        raw = environ.get(var)
        if raw is None or raw.strip() == "":
            continue
        raw = raw.strip()
        if raw not in meanings:
            raise ConfigError(f"environment variable {var}={raw!r} is not understood: allowed values are "
                              f"{', '.join(meanings)} (or unset it)")
        if meanings[raw] is not None:
            section, key, value = meanings[raw]
            out.setdefault(section, {})[key] = value
    return out


def env_alias_config(cfg: EngineConfig, environ=None) -> EngineConfig:
    """cfg with the environment aliases applied."""
    values = env_alias_values(environ)
    if not values:
        return cfg
    return EngineConfig(**{f.name: dataclasses.replace(getattr(cfg, f.name), **values.get(f.name, {}))
                           for f in dataclasses.fields(EngineConfig)})
