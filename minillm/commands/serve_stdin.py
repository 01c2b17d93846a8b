"""`minillm serve-stdin`: JSON request lines on stdin, streamed JSON events on stdout."""
import io
import sys

import typer

from minillm.commands.engine_flags import EngineFlags, build_llm, engine_options


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
