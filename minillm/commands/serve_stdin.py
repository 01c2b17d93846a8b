"""`minillm serve-stdin`: JSON request lines on stdin, streamed JSON events on stdout."""
import io
import sys

import typer

from minillm.commands.common import fail, quiet_broken_pipe
from minillm.commands.engine_flags import EngineFlags, build_llm, engine_options


@engine_options
def serve_stdin(*, engine: EngineFlags) -> None:
    """Online: JSON request lines on stdin, streamed JSON events on stdout.

    \b
    Request lines are those of `minillm generate`; {"abort": ID} aborts a
    request in flight. Events, one JSON object per line, flushed at once:
      {"id", "event": "token", "text", "token_ids"}       zero or more
      {"id", "event": "done", "finish_reason", "usage", "metrics"}
      {"id", "event": "error", "error": {"type", "message"}}
    Every request gets exactly one final event (done or error).
    """
    from minillm.serve.stdin_server import StdinServer

    cfg, sampling = engine.load()
    llm = build_llm(cfg, serving=True)
    typer.echo(f"minillm serve-stdin: ready (max_model_len {llm.max_model_len})", err=True)
    server = StdinServer(llm, sampling, sys.stdout.buffer)
    code = server.serve(_raw_stdin())
    llm.close()
    if server.fatal is not None:
        fail(f"{server.fatal}; every request in flight got an error", code=1)
    if isinstance(server.write_error, BrokenPipeError):
        quiet_broken_pipe()   # the reader went away: nobody is left to tell
    elif server.write_error is not None:
        fail(f"cannot write events to stdout: {server.write_error}", code=1)
    raise typer.Exit(code)


serve_stdin._epilog = ("Exit status: 0 at end of input, once every request has its final event; 1 stdout "
                       "failed; 2 usage or configuration error, before any work; 130 / 143 stopped by SIGINT / "
                       "SIGTERM (every request in flight gets its final event first).")


def _raw_stdin():
    """stdin as an unbuffered file. The reader thread may still be blocked in read() when the server exits;
    a BufferedReader would then abort the interpreter at shutdown (its lock is held), a raw FileIO does not."""
    try:
        return io.FileIO(sys.stdin.fileno(), "rb", closefd=False)
    except (AttributeError, OSError, ValueError):   # no real descriptor (e.g. an in-memory test stdin)
        return sys.stdin.buffer
