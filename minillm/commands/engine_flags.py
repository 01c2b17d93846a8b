"""The engine flags every engine command takes, and building the engine from them.

A command decorated with @engine_options gets --config, --model, --device, ... and --set; they reach it as one
EngineFlags in its `engine` argument.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from minillm.commands.common import fail


@dataclass
class EngineFlags:
    config: Optional[Path] = None
    model: Optional[str] = None
    device: Optional[str] = None
    dtype: Optional[str] = None
    budget: Optional[int] = None
    max_model_len: Optional[int] = None
    chunked: Optional[bool] = None
    policy: Optional[str] = None
    attention: Optional[str] = None
    attention_mode: Optional[str] = None
    kernels: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    eager: bool = False
    dp: Optional[int] = None
    tp: Optional[int] = None
    set: Optional[list[str]] = None

    def overrides(self) -> dict:
        """The explicit flags under their LLM(...) keyword names; None = not given (load_config skips it)."""
        return {"model": self.model, "device": self.device, "dtype": self.dtype,
                "max_num_batched_tokens": self.budget, "max_model_len": self.max_model_len,
                "enable_chunked_prefill": self.chunked, "scheduling_policy": self.policy,
                "attention": self.attention, "attention_mode": self.attention_mode, "kernels": self.kernels,
                "kv_cache_dtype": self.kv_cache_dtype, "enforce_eager": True if self.eager else None,
                "data_parallel_size": self.dp, "tensor_parallel_size": self.tp}

    def load(self):
        """-> (EngineConfig, sampling defaults); a config error ends the command with exit 2."""
        from minillm.config import ConfigError
        from minillm.config_loader import load_config
        try:
            return load_config(self.config, self.set or (), **self.overrides())
        except ConfigError as e:
            fail(str(e))


_P = inspect.Parameter
_ENGINE_PARAMS = [
    _P("config", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[Path], typer.Option(
        "--config", "-c", metavar="FILE",
        help="YAML config (sections model, cache, scheduler, runtime, kernels, sampling).")]),
    _P("model", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="DIR|PRESET", help="HF checkpoint directory, preset name, or demo (default: the config's, else "
                                   "the embedded demo model).")]),
    _P("device", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="DEVICE", help="auto | cpu | cuda | cuda:N")]),
    _P("dtype", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="DTYPE", help="auto | float32 | bfloat16 | float16")]),
    _P("budget", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[int], typer.Option(
        metavar="N", help="Token budget per step (scheduler.max_num_batched_tokens).")]),
    _P("max_model_len", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[int], typer.Option(
        metavar="N", help="Longest prompt + output, in tokens.")]),
    _P("chunked", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[bool], typer.Option(
        "--chunked/--no-chunked", help="Chunked prefill (off = prefill-first).", show_default=False)]),
    _P("policy", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="POLICY", help="fcfs | priority | static")]),
    _P("attention", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="BACKEND", help="auto | cuda | torch")]),
    _P("attention_mode", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="MODE", help="split | unified")]),
    _P("kernels", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="BACKEND", help="auto | cuda | torch: minillm's CUDA kernels (kernels.backend).")]),
    _P("kv_cache_dtype", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        metavar="DTYPE", help="auto | bfloat16 | float16 | float32 | fp8 (e4m3fn) | fp8_e5m2 (cache.kv_cache_dtype).")]),
    _P("eager", _P.KEYWORD_ONLY, default=False, annotation=Annotated[bool, typer.Option(
        "--eager", help="No CUDA graphs (runtime.enforce_eager).")]),
    _P("dp", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[int], typer.Option(
        "--dp", metavar="N", help="Data-parallel engine replicas, one process each (parallel.data_parallel_size).")]),
    _P("tp", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[int], typer.Option(
        "--tp", metavar="N", help="Tensor-parallel ranks per engine (parallel.tensor_parallel_size).")]),
    _P("set", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="SECTION.KEY=VALUE", help="Override any config key; the value is YAML (repeatable).")]),
]


def engine_options(fn):
    """Give a command every engine flag; they reach it as one EngineFlags in its `engine` argument.

    Typer reads a function's signature, so the wrapper advertises the command's own parameters plus the shared
    ones, and regroups the shared ones before the call.
    """
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "engine"]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        flags = EngineFlags(**{p.name: kwargs.pop(p.name) for p in _ENGINE_PARAMS})
        return fn(engine=flags, **kwargs)

    wrapper.__signature__ = inspect.Signature(own + _ENGINE_PARAMS)
    del wrapper.__wrapped__   # typer must see the advertised signature, not the original one
    return wrapper


def build_llm(cfg, serving: bool = False):
    """Load the engine; a missing or unusable model (files, architecture) ends the command with exit 2.
    serving: a serving command (serve, serve-stdin): parallel.engine_process auto runs the core in a process.

    The commands are serving processes, so the heap built so far leaves the cycle collector's reach
    (minillm.llm.freeze_heap: no full-collection pause lands in a token's latency)."""
    from minillm.config import ConfigError
    from minillm.llm import LLM, freeze_heap
    try:
        llm = LLM.from_config(cfg, serving)
    except (ConfigError, FileNotFoundError, ValueError, OSError) as e:
        fail(str(e))
    freeze_heap()
    return llm
