"""`minillm generate INPUT`: offline batch, one JSON answer per request line, in input order."""
import fcntl
import itertools
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO, Iterator, Optional

import typer

from minillm.commands.common import EXIT_CODES, fail, quiet_broken_pipe
from minillm.commands.engine_flags import EngineFlags, build_llm, engine_options
from minillm.commands.serve_stdin import _raw_stdin


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
    source = _open_input(input)
    out = _Output(output, source.identity)
    try:
        llm = build_llm(cfg)
    except BaseException:   # a start-up error: leave the output file as it was
        out.discard()
        raise
    try:
        summary = run_generate(llm, source.lines, sampling, out.stream, progress=progress, total=source.total,
                               finite=source.finite)
    finally:
        source.close()
        out.finish()
    if progress:
        Console(stderr=True).print(summary_table(summary))
    _report_stop(summary, output)
    raise typer.Exit(summary.exit_code)


generate._epilog = EXIT_CODES


@dataclass
class _Input:
    lines: Iterator            # (line number, raw bytes or TooLong) of every non-blank line, read as it goes
    total: int | None          # request lines, when known up front (a file)
    finite: bool               # the input ends by itself (a regular file, also as stdin)
    identity: tuple | None     # (st_dev, st_ino) of a regular file, to refuse it as the output
    stream: BinaryIO | None = None

    def close(self) -> None:
        if self.stream is not None and self.stream is not sys.stdin.buffer:
            self.stream.close()


def _open_input(source: str) -> _Input:
    """The request lines, streamed; exit 2 when there are none, before the model loads: a file is counted in
    one pass (nothing kept), stdin is read up to its first request line."""
    from minillm.serve.requests import is_blank, iter_lines
    if source == "-":
        if sys.stdin is None:
            fail("no standard input to read requests from")
        stream, name = _raw_stdin(), "stdin"
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            fail(f"input file not found: {path}" if not path.exists() else f"input {path} is not a file")
        try:
            stream = path.open("rb")
        except OSError as e:
            fail(f"cannot read input file {path}: {e.strerror}")
        name = source
    identity = _regular_file_identity(stream)
    total = None
    if source != "-":
        try:
            total = sum(1 for _, raw in iter_lines(stream) if not is_blank(raw))
            stream.seek(0)
        except OSError as e:
            fail(f"cannot read input file {source}: {e.strerror}")
    lines = ((n, raw) for n, raw in iter_lines(stream) if not is_blank(raw))
    first = next(lines, None) if total is None else None
    if total == 0 or (total is None and first is None):
        fail(f"{name} has no request lines (expected one JSON object per line)")
    if first is not None:
        lines = itertools.chain([first], lines)
    return _Input(lines, total, identity is not None, identity, stream)


def _regular_file_identity(stream) -> tuple | None:
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):   # an in-memory stdin (tests)
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


class _Output:
    """Where the answers go. A regular file (or a new one) is written as a temporary file in its directory that
    replaces it at the end (os.replace is atomic), and the run holds an exclusive lock on the file meanwhile: a
    second run writing the same path at the same time is refused (exit 2) instead of one run's answers silently
    replacing the other's, and a reader never sees half a file. Anything else (stdout, /dev/null, a FIFO) is
    written directly."""

    def __init__(self, output: Optional[Path], input_identity: tuple | None):
        self.path, self.temp, self.lock_fd, self.created = None, None, None, False
        if output is None:
            self.stream = sys.stdout.buffer
            return
        path = output.expanduser()
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        except OSError as e:
            fail(f"cannot write output file {output}: {e.strerror}")
        if st is not None and (st.st_dev, st.st_ino) == input_identity:
            fail(f"--output {output} is the input file: the answers would overwrite the requests; write them to "
                 f"another file")
        if st is not None and not stat.S_ISREG(st.st_mode):
            self.stream = self._open(lambda: path.open("wb"), output)
            return
        path = path.resolve()   # a symlink's target is replaced, not the link
        self.path, self.created = path, st is None
        self.lock_fd = self._open(lambda: os.open(path, os.O_RDWR | os.O_CREAT, 0o666), output)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock_fd)
            fail(f"--output {output} is being written by another run right now; wait for it or pick another file")
        fd, temp = self._open(lambda: tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent),
                              output)
        self.temp = Path(temp)
        os.chmod(fd, os.fstat(self.lock_fd).st_mode & 0o777)   # the mode the file has (or a new one would get)
        self.stream = os.fdopen(fd, "wb")

    @staticmethod
    def _open(opener, output):
        try:
            return opener()
        except OSError as e:
            fail(f"cannot write output file {output}: {e.strerror}")

    def finish(self) -> None:
        """Close the output; a temporary file replaces the target (the answers before a failed write are
        complete lines). A buffered write that fails only now (a full disk) was already reported."""
        if self.stream is sys.stdout.buffer:
            return
        try:
            self.stream.close()
        except OSError:
            pass
        if self.temp is not None:
            os.replace(self.temp, self.path)
            self._unlock()

    def discard(self) -> None:
        """The run did not happen (a start-up error): leave the target as it was."""
        if self.temp is None:
            return
        try:
            self.stream.close()
        except OSError:
            pass
        self.temp.unlink(missing_ok=True)
        if self.created:
            self.path.unlink(missing_ok=True)
        self._unlock()

    def _unlock(self) -> None:
        os.close(self.lock_fd)   # releases the lock
        self.temp = None


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
