"""`minillm generate INPUT`: offline batch, one JSON answer per request line, in input order."""
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from minillm.commands.common import EXIT_CODES, fail, quiet_broken_pipe
from minillm.commands.engine_flags import EngineFlags, build_llm, engine_options


@engine_options
def generate(
    input: Annotated[str, typer.Argument(help="JSONL file of requests, or - for stdin.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE",
                                                   help="Write answers here (default stdout).")] = None,
    progress: Annotated[bool, typer.Option(help="Progress bar and summary table on stderr.")] = True,
    *, engine: EngineFlags,
) -> None:
    """Offline batch: one JSON answer per line of INPUT, in input order.

    \b
    Each line is a JSON object with exactly one of
      "prompt": "text"
      "messages": [{"role": "user", "content": "text"}, ...]
      "prompt_token_ids": [1, 2, 3]
    and optionally "id" (a string or an integer, echoed back; default: the
    line number), temperature, top_p, top_k, min_p, max_tokens, min_tokens,
    stop, stop_token_ids, seed, ignore_eos, n, presence_penalty,
    frequency_penalty, repetition_penalty, logprobs, priority, and with
    "messages" also enable_thinking. Missing fields take the config's
    sampling section. Constrained outputs: response_format or
    structured_outputs, as in the HTTP API (docs/structured.md).

    \b
    Each answer is {"id", "text", "token_ids", "finish_reason", "usage"},
    or {"id", "error": {"type", "message"}} for a line that cannot be served.
    """
    from rich.console import Console

    from minillm.serve.generate_jsonl import run_generate, summary_table

    cfg, sampling = engine.load()
    lines = _read_requests(input)
    out = _open_output(output)
    llm = build_llm(cfg)
    try:
        summary = run_generate(llm, lines, sampling, out, progress=progress)
    finally:
        _close(out, output)
    if progress:
        Console(stderr=True).print(summary_table(summary))
    _report_stop(summary, output)
    raise typer.Exit(summary.exit_code)


generate._epilog = EXIT_CODES


def _read_requests(source: str) -> list:
    """Every non-blank line as (line number, raw bytes or TooLong); exit 2 when there is nothing to serve."""
    from minillm.serve.requests import is_blank, iter_lines
    if source == "-":
        if sys.stdin is None:
            fail("no standard input to read requests from")
        lines = list(iter_lines(sys.stdin.buffer))
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            fail(f"input file not found: {path}" if not path.exists() else f"input {path} is not a file")
        try:
            with path.open("rb") as f:
                lines = list(iter_lines(f))
        except OSError as e:
            fail(f"cannot read input file {path}: {e.strerror}")
    lines = [(n, raw) for n, raw in lines if not is_blank(raw)]
    if not lines:
        fail(f"{'stdin' if source == '-' else source} has no request lines (expected one JSON object per line)")
    return lines


def _open_output(output: Optional[Path]):
    if output is None:
        return sys.stdout.buffer
    try:
        return output.expanduser().open("wb")
    except OSError as e:
        fail(f"cannot write output file {output}: {e.strerror}")


def _close(out, output: Optional[Path]) -> None:
    """Close the output file; a buffered write that fails only now (a full disk) was already reported."""
    if output is None:
        return
    try:
        out.close()
    except OSError:
        pass


def _report_stop(summary, output: Optional[Path]) -> None:
    error = summary.write_error
    if isinstance(error, BrokenPipeError) and output is None:
        quiet_broken_pipe()   # the reader (e.g. `| head -1`) has what it wanted: end without a word
        raise typer.Exit(1)
    if error is not None:
        fail(f"cannot write answers to {output or 'stdout'}: {error.strerror or error}; the answers before "
             f"it are complete lines", code=1)
    if summary.stopped_by is not None and summary.stopped_by.requested:
        typer.echo(f"minillm: stopped by {summary.stopped_by.name}: requests in flight were answered with "
                   f"finish_reason \"abort\", lines not started with an \"interrupted\" error", err=True)
