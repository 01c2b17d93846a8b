"""The `minillm` command line: parse flags, load the config, call into the engine. No engine logic lives here.

Nothing heavy is imported at module level (no torch), so `minillm --help` answers at once; the engine is
imported when a command actually runs. Exit status: 0 success, 1 some input lines failed, 2 usage or config
error (reported before any work starts), 130 interrupted.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

# name -> (module, attribute, one-line help). Loaded only when the command runs or shows its own --help.
LAZY_COMMANDS = {
    "bench": ("minillm.bench.commands", "bench_command", "Offline throughput on the reference workload."),
    "latency-sweep": ("minillm.bench.commands", "latency_sweep_command",
                      "Online latency under Poisson arrivals, over several configs."),
    "check-kernels": ("minillm.ops.check", "check_kernels_command",
                      "Check every CUDA kernel against its fp32 reference, then time it."),
    "serve": ("minillm.serve.http.command", "serve_command",
              "OpenAI-compatible HTTP server (completions, chat, SSE streaming, metrics)."),
}


class _LazyGroup(TyperGroup):
    """Lists the lazy commands from their one-line help; imports a command's module only to run it."""

    def list_commands(self, ctx) -> list[str]:
        return super().list_commands(ctx) + sorted(LAZY_COMMANDS)

    def get_command(self, ctx, name: str):
        if name in LAZY_COMMANDS and name not in self.commands:
            # Top-level --help asks every command for its help line; a stub answers without importing.
            return typer.main.get_command(_single(name, _stub_help(name)))
        return super().get_command(ctx, name)

    def resolve_command(self, ctx, args):
        if args and args[0] in LAZY_COMMANDS and args[0] not in self.commands:
            self.add_command(_load_lazy(args[0]), args[0])
        return super().resolve_command(ctx, args)


def _single(name: str, fn) -> typer.Typer:
    sub = typer.Typer(add_completion=False)
    sub.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True}
                if getattr(fn, "_accepts_anything", False) else None)(fn)
    return sub


def _stub_help(name: str):
    def stub() -> None:
        raise AssertionError("listing stub is never invoked")
    stub.__doc__ = LAZY_COMMANDS[name][2]
    return stub


def _load_lazy(name: str):
    module_name, attr, help_line = LAZY_COMMANDS[name]
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise   # the module exists but one of its own imports is broken: show that, do not hide it
        fn = _not_built(name, help_line)
    except AttributeError:
        fn = _not_built(name, help_line)
    return typer.main.get_command(_single(name, fn))


def _not_built(name: str, help_line: str):
    def not_built() -> None:
        _fail(f"`{name}` is not built yet in this tree")
    not_built.__doc__ = f"{help_line} (not built yet)"
    not_built._accepts_anything = True   # `minillm bench --budget 2048` must say "not built", not "no such option"
    return not_built


app = typer.Typer(cls=_LazyGroup, name="minillm", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False,
                  help="minillm: a small LLM inference engine for Qwen3 / Qwen2. Every engine command builds the "
                       "same engine from a YAML config (--config) plus flags and --set section.key=value.")


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"minillm: error: {message}", err=True)
    raise typer.Exit(code)


# ---------------------------------------------------------------- engine flags, shared by every engine command

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
    eager: bool = False
    set: Optional[list[str]] = None

    def load(self):
        """-> (EngineConfig, sampling defaults); a config error ends the command with exit 2."""
        from minillm.config import ConfigError
        from minillm.config_loader import load_config
        try:
            return load_config(self.config, self.set or (), model=self.model, device=self.device, dtype=self.dtype,
                               max_num_batched_tokens=self.budget, max_model_len=self.max_model_len,
                               enable_chunked_prefill=self.chunked, scheduling_policy=self.policy,
                               attention=self.attention, attention_mode=self.attention_mode,
                               enforce_eager=True if self.eager else None)
        except ConfigError as e:
            _fail(str(e))


_P = inspect.Parameter
_ENGINE_PARAMS = [
    _P("config", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[Path], typer.Option(
        "--config", "-c", help="YAML config (sections model, cache, scheduler, runtime, sampling).")]),
    _P("model", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        help="HF checkpoint directory or preset name; default: the embedded demo model.")]),
    _P("device", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        help="auto | cpu | cuda | cuda:N")]),
    _P("dtype", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        help="auto | float32 | bfloat16 | float16")]),
    _P("budget", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[int], typer.Option(
        help="Token budget per step (scheduler.max_num_batched_tokens).")]),
    _P("max_model_len", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[int], typer.Option(
        help="Longest prompt + output, in tokens.")]),
    _P("chunked", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[bool], typer.Option(
        "--chunked/--no-chunked", help="Chunked prefill (off = prefill-first).", show_default=False)]),
    _P("policy", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        help="fcfs | priority | static")]),
    _P("attention", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        help="auto | cuda | torch")]),
    _P("attention_mode", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], typer.Option(
        help="split | unified")]),
    _P("eager", _P.KEYWORD_ONLY, default=False, annotation=Annotated[bool, typer.Option(
        "--eager", help="No CUDA graphs (runtime.enforce_eager).")]),
    _P("set", _P.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[list[str]], typer.Option(
        "--set", help="Override any config key: section.key=value (repeatable).")]),
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


def build_llm(cfg):
    """Load the engine; a missing or unusable model (files, architecture) ends the command with exit 2."""
    from minillm.config import ConfigError
    from minillm.llm import LLM
    try:
        return LLM.from_config(cfg)
    except (ConfigError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e))


# ---------------------------------------------------------------- commands

@app.command()
@engine_options
def generate(
    input: Annotated[str, typer.Argument(help="JSONL file of requests, or - for stdin.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write answers here (default stdout).")]
    = None,
    progress: Annotated[bool, typer.Option(help="Progress bar and summary table on stderr.")] = True,
    *, engine: EngineFlags,
) -> None:
    """Offline batch: one JSON answer per input line, in input order."""
    from rich.console import Console

    from minillm.serve.generate_jsonl import run_generate, summary_table

    cfg, sampling = engine.load()
    lines = _read_requests(input)
    out = _open_output(output)
    llm = build_llm(cfg)
    try:
        summary = run_generate(llm, lines, sampling, out, progress=progress)
    except KeyboardInterrupt:
        _fail("interrupted; the answers written so far are complete lines", code=130)
    finally:
        if output is not None:
            out.close()
    if progress:
        Console(stderr=True).print(summary_table(summary))
    raise typer.Exit(summary.exit_code)


def _read_requests(source: str) -> list:
    """Every non-blank line as (line number, raw bytes or TooLong); exit 2 when there is nothing to serve."""
    from minillm.serve.requests import is_blank, iter_lines
    if source == "-":
        lines = list(iter_lines(sys.stdin.buffer))
    else:
        path = Path(source)
        if not path.is_file():
            _fail(f"input file not found: {path}")
        with path.open("rb") as f:
            lines = list(iter_lines(f))
    lines = [(n, raw) for n, raw in lines if not is_blank(raw)]
    if not lines:
        _fail(f"{'stdin' if source == '-' else source} has no request lines (expected one JSON object per line)")
    return lines


def _open_output(output: Optional[Path]):
    if output is None:
        return sys.stdout.buffer
    try:
        return output.open("wb")
    except OSError as e:
        _fail(f"cannot write output file {output}: {e.strerror}")


@app.command("serve-stdin")
@engine_options
def serve_stdin(*, engine: EngineFlags) -> None:
    """Online: JSON request lines on stdin, streamed JSON events on stdout ({"abort": ID} aborts)."""
    from minillm.serve.stdin_server import StdinServer

    cfg, sampling = engine.load()
    llm = build_llm(cfg)
    typer.echo(f"minillm serve-stdin: ready (max_model_len {llm.max_model_len})", err=True)
    raise typer.Exit(StdinServer(llm, sampling, sys.stdout.buffer).serve(_raw_stdin()))


def _raw_stdin():
    """stdin as an unbuffered file. The reader thread may still be blocked in read() when the server exits;
    a BufferedReader would then abort the interpreter at shutdown (its lock is held), a raw FileIO does not."""
    try:
        return io.FileIO(sys.stdin.fileno(), "rb", closefd=False)
    except (AttributeError, OSError, ValueError):   # no real descriptor (e.g. an in-memory test stdin)
        return sys.stdin.buffer


def main() -> None:
    app(prog_name="minillm")
