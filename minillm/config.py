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


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "None": "null"}


def _type_ok(value, type_name: str) -> bool:
    # bool is an int subclass in Python, so check it explicitly: `block_size: true` must be refused.
    if type_name == "None":
        return value is None
    if type_name == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if type_name == "int":
        return isinstance(value, int)
    if type_name == "float":
        return isinstance(value, (int, float))
    if type_name == "str":
        return isinstance(value, str)
    raise AssertionError(f"config field type {type_name!r} has no checker")


def check_types(section: str, obj) -> None:
    """Every field of a config section has its annotated type exactly (the annotations are strings here, e.g.
    "int | None"), whichever way it was built: YAML, --set, flags, LLM(**kw) or the dataclass itself."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        allowed = [part.strip() for part in str(f.type).split("|")]
        if not any(_type_ok(value, t) for t in allowed):
            from minillm.untrusted import short_repr
            words = " or ".join(_TYPE_NAMES[t] for t in allowed)
            raise ConfigError(f"{section}.{f.name}={short_repr(value)} has the wrong type: expected {words}")


def _is_int(v, low: int, high: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # HF directory, preset name (e.g. "qwen3-0.6b") or None = demo model
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16
    load_format: str = "auto"         # auto | safetensors | dummy
    max_model_len: int | None = None  # None = from the model's config (capped by max_position_embeddings)

    def validate(self) -> None:
        check_types("model", self)
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
    kv_cache_dtype: str = "auto"          # auto = the model dtype; fp8 (= e4m3fn), fp8_e5m2: docs/kv-fp8.md
    calculate_kv_scales: bool = True      # fp8 without checkpoint scales: scales from a start-up calibration prefill

    def validate(self) -> None:
        check_types("cache", self)
        _check(self.block_size in (8, 16, 32, 64), "cache.block_size", self.block_size, "one of 8, 16, 32, 64")
        _check(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1),
               "cache.num_kv_blocks", self.num_kv_blocks, "an integer >= 1 or null")
        _check(isinstance(self.gpu_memory_utilization, (int, float)) and 0.05 <= self.gpu_memory_utilization <= 0.99,
               "cache.gpu_memory_utilization", self.gpu_memory_utilization, "a number in [0.05, 0.99]")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "cache.kv_cache_dtype", self.kv_cache_dtype,
               f"one of {', '.join(KV_CACHE_DTYPES)} (auto = the model dtype; fp8 = e4m3fn)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # 0 = no per-request chunk cap
    policy: str = "fcfs"                    # fcfs | priority | static

    def validate(self) -> None:
        check_types("scheduler", self)
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
    # torch's intra-op CPU threads, set when the engine starts (process-wide: it also changes the caller's torch).
    # auto: torch's own setting is left alone. On the H200 host 1 and 16 measured the same offline (f642573).
    host_threads: int | str = "auto"

    def host_threads_for(self) -> int | None:
        """The intra-op thread count to set when the engine starts, or None to leave torch's."""
        return None if self.host_threads == "auto" else self.host_threads

    def validate(self) -> None:
        check_types("runtime", self)
        _check(self.host_threads == "auto" or _is_int(self.host_threads, 1, 1024), "runtime.host_threads",
               self.host_threads, "auto or an integer in [1, 1024]")
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
    """Which kernels run, and their tuning values. Resolved once per engine into an ExecutionPlan
    (minillm/runner/plan.py) whose decisions the model, the attention backend and the sampler receive."""
    backend: str = "auto"             # auto (minillm's CUDA kernels on a GPU when they build) | cuda | torch
    skinny_gemm: bool = True          # decode-sized linear layers on the skinny GEMM where it beats cuBLAS
    decode_gemm: bool = True          # ... and on the decode GEMM where it measured faster than both (it goes first)
    moe: bool = True                  # decode-sized mixture-of-experts steps on the fused routing + expert kernels
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
    # Long prefill chunks run on cuDNN's fused attention instead of minillm's paged prefill kernel, where the plan
    # finds it covered (minillm/runner/plan.py; attention_ops.prefill_cudnn): a whole prompt in one chunk (no cached
    # prefix, no earlier chunk) of at least prefill_sdpa_min_tokens queries, and with prefill_sdpa_prefix a chunk
    # over a cached prefix of at least prefill_sdpa_prefix_min_tokens. On the H200 (scripts/prefill_bench.py,
    # 72767c5) one call on cuDNN was slower than the wgmma kernel for whole prompts of 2,048 tokens (0.096 vs 0.069
    # ms, 0.6B shape; 8B 0.141 vs 0.133) and faster from 4,096 (0.22 vs 0.24; 8B 0.36 vs 0.46). Chunks over a
    # prefix were faster on cuDNN from 1,024 queries over a 7k prefix (0.18 vs 0.24 ms) and 2,048 over 14k (1.6x),
    # but each new (queries, prefix) shape costs a cuDNN plan of ~40-80 ms, which warm-up does not build (it builds
    # whole-prompt shapes): in engine runs of the long-prompt workload prefix chunks from 2,048 (144,843 total
    # tok/s, 72767c5, whole prompts from 2,048) beat prefix chunks from 1,024 (137,708, 3cc5ae7, whole from 4,096).
    prefill_sdpa: bool = True
    prefill_sdpa_min_tokens: int = 4096
    prefill_sdpa_prefix: bool = True
    prefill_sdpa_prefix_min_tokens: int = 2048

    def validate(self) -> None:
        check_types("kernels", self)
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
        for key in ("prefill_sdpa_min_tokens", "prefill_sdpa_prefix_min_tokens"):
            _check(_is_int(getattr(self, key), 1, 1 << 24), f"kernels.{key}", getattr(self, key),
                   "an integer in [1, 16777216] (queries of a prefill chunk)")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class StructuredConfig:
    """Structured outputs (minillm/structured/): how JSON grammars treat whitespace, and the bounds on compiling."""
    json_whitespace: str = "compact"      # compact: no whitespace between JSON tokens | any: up to max_whitespace
    max_whitespace: int = 2               # json_whitespace any: the most whitespace characters in one run
    compile_timeout_s: float = 10.0       # a grammar that does not compile in time is refused
    compile_threads: int = 2              # compiles run on this many threads, never on the engine's
    mask_threads: int = 1                 # threads xgrammar fills a step's bitmask rows on (B=64 on the H200
                                          # host: 1 thread measured faster than 4)
    mask_worker: str | bool = "auto"      # the matchers in a process of their own, filling beside the engine;
                                          # auto: on CUDA with one rank (B=64 all constrained on the H200: +36%
                                          # a step against +72% on a thread of the engine's process, b6899bc)
    mask_workers: int = 1                 # worker processes the matchers are spread over (mask_worker): each
                                          # request's matcher lives in one, a step's rows fill side by side
    overlap_masks: bool = True            # the sampler waits for its masks at the next launch (fills overlap the
                                          # host work); false: at once (tensor parallelism always does)
    mask_wait: str = "auto"               # overlapped masks, auto: on CUDA with the kernels and one rank the
                                          # stream waits on a host flag the filler sets (the sampler is queued
                                          # behind the forward; B=64 all constrained on the H200 +25% a step
                                          # against +44%, 8a67e15); host: the host launches the sampler late
    max_spec_bytes: int = 65536           # a schema, regex, choice list or grammar longer than this is refused
    max_grammar_bytes: int = 64 << 20     # a compiled grammar larger than this is refused
    cache_size: int = 256                 # compiled grammars kept (least recently used go first)

    def matchers_in_worker(self, device_type: str, tensor_parallel_size: int) -> bool:
        """Whether the grammar matchers run in a worker process (else on a thread of the engine's process). On a
        CPU the engine's own math wants the cores; with TP the deferred sampler would reorder rank 0's collectives."""
        if self.mask_worker == "auto":
            return device_type == "cuda" and tensor_parallel_size == 1
        return self.mask_worker

    def gpu_waits_for_masks(self, device_type: str, tensor_parallel_size: int, kernels: bool) -> bool:
        """Whether an overlapped step's stream waits for its bitmask on a host flag (cuda/grammar_mask.cu) instead
        of the host launching its sampler late: CUDA with the engine's kernels and one rank, masks overlapped."""
        usable = device_type == "cuda" and kernels and tensor_parallel_size == 1 and self.overlap_masks
        return usable and self.mask_wait != "host"

    def validate(self) -> None:
        check_types("structured", self)
        _check(self.json_whitespace in ("compact", "any"), "structured.json_whitespace", self.json_whitespace,
               "compact or any")
        _check(_is_int(self.max_whitespace, 1, 64), "structured.max_whitespace", self.max_whitespace,
               "an integer in [1, 64]")
        _check(isinstance(self.compile_timeout_s, (int, float)) and not isinstance(self.compile_timeout_s, bool)
               and 0 < self.compile_timeout_s <= 600, "structured.compile_timeout_s", self.compile_timeout_s,
               "a number of seconds in (0, 600]")
        _check(_is_int(self.compile_threads, 1, 64), "structured.compile_threads", self.compile_threads,
               "an integer in [1, 64]")
        _check(_is_int(self.mask_threads, 1, 64), "structured.mask_threads", self.mask_threads,
               "an integer in [1, 64]")
        _check(self.mask_worker in ("auto", True, False), "structured.mask_worker", self.mask_worker,
               "auto, true or false")
        _check(_is_int(self.mask_workers, 1, 16), "structured.mask_workers", self.mask_workers,
               "an integer in [1, 16]")
        _check(isinstance(self.overlap_masks, bool), "structured.overlap_masks", self.overlap_masks, "true or false")
        _check(self.mask_wait in ("auto", "host"), "structured.mask_wait", self.mask_wait, "auto or host")
        _check(_is_int(self.max_spec_bytes, 16), "structured.max_spec_bytes", self.max_spec_bytes,
               "an integer >= 16")
        _check(_is_int(self.max_grammar_bytes, 1 << 10), "structured.max_grammar_bytes", self.max_grammar_bytes,
               "an integer >= 1024")
        _check(_is_int(self.cache_size, 1), "structured.cache_size", self.cache_size, "an integer >= 1")


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
        check_types("parallel", self)
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
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "EngineConfig":
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if type(section).__name__ != f.type:   # e.g. EngineConfig(cache={...}) instead of a CacheConfig
                raise ConfigError(f"EngineConfig.{f.name} must be a {f.type}, got {type(section).__name__}")
            section.validate()
        if self.kernels.backend == "torch" and self.runtime.attention == "cuda":
            raise ConfigError("runtime.attention='cuda' is not allowed with kernels.backend='torch' (no minillm "
                              "kernel runs then): use runtime.attention auto or torch, or kernels.backend auto")
        if self.structured.mask_worker is True and self.parallel.tensor_parallel_size > 1:
            # Its deferred sampler launch would reorder rank 0's collectives against the other ranks'.
            raise ConfigError("structured.mask_worker=true is not allowed with parallel.tensor_parallel_size > 1")
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
        "async_scheduling": ("runtime", "async_scheduling"), "host_threads": ("runtime", "host_threads"),
        "kv_cache_dtype": ("cache", "kv_cache_dtype"), "calculate_kv_scales": ("cache", "calculate_kv_scales"),
        "kernels": ("kernels", "backend"), "skinny_gemm": ("kernels", "skinny_gemm"),
        "decode_gemm": ("kernels", "decode_gemm"), "moe_kernels": ("kernels", "moe"),
        "decode_min_partitions": ("kernels", "decode_min_partitions"),
        "decode_ctas_per_sm": ("kernels", "decode_ctas_per_sm"), "megakernel": ("kernels", "megakernel"),
        "megakernel_max_batch": ("kernels", "megakernel_max_batch"),
        "megakernel_max_tokens": ("kernels", "megakernel_max_tokens"),
        "megakernel_min_chunks": ("kernels", "megakernel_min_chunks"), "pdl": ("kernels", "pdl"),
        "prefill_sdpa": ("kernels", "prefill_sdpa"), "prefill_sdpa_min_tokens": ("kernels", "prefill_sdpa_min_tokens"),
        "prefill_sdpa_prefix": ("kernels", "prefill_sdpa_prefix"),
        "prefill_sdpa_prefix_min_tokens": ("kernels", "prefill_sdpa_prefix_min_tokens"),
        "json_whitespace": ("structured", "json_whitespace"),
        **{f"structured_{k}": ("structured", k) for k in ("max_whitespace", "compile_timeout_s", "compile_threads",
                                                         "mask_threads", "mask_worker", "mask_workers",
                                                         "overlap_masks", "mask_wait", "max_spec_bytes",
                                                         "max_grammar_bytes", "cache_size")},
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
