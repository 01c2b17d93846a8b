"""What every command shares: the one way to stop with an error, the exit codes, readable --help pages."""
from __future__ import annotations

import os
import sys
from typing import NoReturn

import typer
from typer.core import TyperArgument, TyperCommand, TyperOption

# Placeholders for option values whose type says nothing better; options with a more telling name (N, FILE,
# DIR|PRESET, KEY=VALUE) set their metavar where they are declared. Newer typer releases describe a type in their
# own words (int, list[str]), older ones through click's parameter types (integer, text): both are listed.
_TYPE_WORDS = {"int": "INTEGER", "float": "NUMBER", "str": "TEXT", "path": "PATH", "list[str]": "TEXT",
               "list[int]": "INTEGER", "list[path]": "PATH", "integer": "INTEGER", "text": "TEXT", "filename": "FILE"}


EXIT_CODES = ("Exit status: 0 every line answered; 1 some lines got an error answer (all others were still "
              "answered), or the output could not be written; 2 usage or configuration error, before any work; "
              "130 / 143 stopped by SIGINT / SIGTERM (every request in flight still gets its final line).")


def quiet_broken_pipe() -> None:
    """The reader of stdout went away (`minillm ... | head -1`). Point stdout at /dev/null so that the
    interpreter's final flush does not print a BrokenPipeError of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def fail(message: str, code: int = 2) -> NoReturn:
    """Stop the command: one `minillm: error: ...` line on stderr, exit status `code` (2 = usage/config)."""
    typer.echo(f"minillm: error: {message}", err=True)
    raise typer.Exit(code)


class _PlainArgument(TyperArgument):
    """An argument shown as INPUT in the usage line and without a `<str>` type tag in the table."""

    def display_type_rich(self, ctx) -> None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        return name if self.required else f"[{name}]"


def _tidy(param) -> None:
    if isinstance(param, TyperArgument):
        if param.metavar is None:
            param.metavar = param.name.upper()
        # Same object, a subclass that only changes how it is displayed.
        param.__class__ = _PlainArgument
    elif isinstance(param, TyperOption) and param.metavar is None:
        if param.is_flag:
            param.metavar = ""   # a flag takes no value: show none, not `<bool>`
        else:
            label = _type_label(param)
            param.metavar = _TYPE_WORDS.get(label, label.upper())


def _type_label(param) -> str:
    """The option's value type in one word, asked in whichever way the installed typer supports."""
    display = getattr(param, "display_type", None)   # newer typer: its own type descriptors, no click types
    if display is not None:
        return display(None).strip("<>")
    kind = getattr(param, "type", None)
    choices = getattr(kind, "choices", None)
    if choices:
        return "|".join(str(c) for c in choices)
    return (getattr(kind, "name", None) or "text").split()[0]   # click's "integer range" -> integer


def tidy_help_option(option):
    if option is not None and option.metavar is None:
        option.metavar = ""
    return option


class HelpTidyCommand(TyperCommand):
    """A command whose --help reads like a man page: `INPUT` rather than `{input}`, `--budget N` rather than
    `--budget <int>`, no `<bool>` after flags."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            _tidy(param)

    def get_help_option(self, ctx):
        return tidy_help_option(super().get_help_option(ctx))
