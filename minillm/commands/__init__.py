"""The `minillm` command line: every command and the shared engine flags live in this package.

Nothing heavy is imported here (no torch), so `minillm --help` answers at once. Each command lives in its own
module, named in COMMANDS, and is imported only when it runs or shows its own --help. Adding a command is one
entry in COMMANDS: (module, function, one-line help). Exit status: 0 success, 1 some input lines failed,
2 usage or configuration error (reported before any work starts), 130 interrupted (SIGINT), 143 terminated
(SIGTERM).
"""
from __future__ import annotations

import importlib

import typer
from typer.core import TyperGroup

from minillm.commands.common import HelpTidyCommand, fail, tidy_help_option

# name -> (module, attribute, one-line help), in the order `minillm --help` lists them.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("minillm.commands.generate", "generate", "Offline batch: JSONL in, one answer per line out."),
    "serve-stdin": ("minillm.commands.serve_stdin", "serve_stdin",
                    "Online: requests on stdin, streamed events on stdout."),
    "bench": ("minillm.commands.bench", "bench_command", "Offline throughput on the reference workload."),
    "latency-sweep": ("minillm.commands.bench", "latency_sweep_command",
                      "Online latency (TTFT, ITL) under Poisson arrivals."),
    "check-kernels": ("minillm.commands.check_kernels", "check_kernels_command",
                      "Check and time every CUDA kernel (needs a GPU)."),
    "serve": ("minillm.commands.serve", "serve_command", "OpenAI-compatible HTTP server (SSE, metrics)."),
}
LAZY_COMMANDS = COMMANDS   # the older name, kept for code that patches the registry


class _LazyGroup(TyperGroup):
    """Lists the commands from their one-line help; imports a command's module only to run it."""

    def list_commands(self, ctx) -> list[str]:
        return super().list_commands(ctx) + [n for n in COMMANDS if n not in self.commands]

    def get_command(self, ctx, name: str):
        if name in COMMANDS and name not in self.commands:
            # Top-level --help asks every command for its help line; a stub answers without importing.
            return typer.main.get_command(_single(name, _stub_help(name)))
        return super().get_command(ctx, name)

    def resolve_command(self, ctx, args):
        if args and args[0] in COMMANDS and args[0] not in self.commands:
            self.add_command(_load(args[0]), args[0])
        return super().resolve_command(ctx, args)

    def get_help_option(self, ctx):
        return tidy_help_option(super().get_help_option(ctx))


def _single(name: str, fn) -> typer.Typer:
    sub = typer.Typer(add_completion=False, rich_markup_mode=None)
    settings = {"ignore_unknown_options": True, "allow_extra_args": True} \
        if getattr(fn, "_accepts_anything", False) else None
    sub.command(name=name, cls=HelpTidyCommand, context_settings=settings,
                epilog=getattr(fn, "_epilog", None))(fn)
    return sub


def _stub_help(name: str):
    def stub() -> None:
        raise AssertionError("listing stub is never invoked")
    stub.__doc__ = COMMANDS[name][2]
    return stub


def _load(name: str):
    module_name, attr, help_line = COMMANDS[name]
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
        fail(f"`{name}` is not built yet in this tree")
    not_built.__doc__ = f"{help_line} (not built yet)"
    not_built._accepts_anything = True   # `minillm bench --budget 2048` must say "not built", not "no such option"
    return not_built


app = typer.Typer(cls=_LazyGroup, name="minillm", no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  pretty_exceptions_show_locals=False,
                  help="minillm: a small LLM inference engine for Qwen3 / Qwen2. Every engine command builds the "
                       "same engine from a YAML config (--config) plus flags and --set section.key=value.")


@app.callback()
def _group() -> None:
    # Every command is registered lazily (COMMANDS), so the app needs a callback to be a command group at all.
    pass


def main() -> None:
    app(prog_name="minillm")
