"""`minillm generate INPUT`: offline batch, one JSON answer per request line, in input order."""
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from minillm.commands.common import fail
from minillm.commands.engine_flags import EngineFlags, build_llm, engine_options


@engine_options
def generate(
    input: Annotated[str, typer.Argument(help="JSONL file of requests, or - for stdin.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE",
                                                   help="Write answers here (default stdout).")] = None,
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
        fail("interrupted; the answers written so far are complete lines", code=130)
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
            fail(f"input file not found: {path}")
        with path.open("rb") as f:
            lines = list(iter_lines(f))
    lines = [(n, raw) for n, raw in lines if not is_blank(raw)]
    if not lines:
        fail(f"{'stdin' if source == '-' else source} has no request lines (expected one JSON object per line)")
    return lines


def _open_output(output: Optional[Path]):
    if output is None:
        return sys.stdout.buffer
    try:
        return output.open("wb")
    except OSError as e:
        fail(f"cannot write output file {output}: {e.strerror}")
