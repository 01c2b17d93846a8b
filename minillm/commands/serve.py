"""`minillm serve`: the engine flags plus the server's own, then uvicorn until SIGTERM/SIGINT.

The port is bound before the model loads, so a port in use fails at once (exit 2); clients are accepted only once
the engine loop runs, and "ready" on stderr names the address (with --port 0, the port the system chose).
SIGTERM or SIGINT: no new connections, requests in flight may finish within --drain-timeout, then the rest are
aborted and the process exits 0 (a second SIGINT skips the wait: exit 130).
"""
# NOTE: no `from __future__ import annotations`: engine_options reads this signature with the aliases below.
import contextlib
import importlib.util
import math
import signal
import socket
from typing import Annotated, Optional

import typer
import uvicorn

from minillm.commands.common import fail
from minillm.commands.engine_flags import EngineFlags, build_llm, engine_options
from minillm.llm import freeze_heap
from minillm.serve.http.app import create_app
from minillm.serve.http.server_config import uvicorn_config
from minillm.serve.http.settings import (DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING,
                                         ServerSettings)
from minillm.untrusted import short_repr

DEMO_MODEL_NAME = "minillm-demo"
MAX_DRAIN_TIMEOUT_S = 86400
LOG_LEVELS = tuple(uvicorn.config.LOG_LEVELS)   # critical, error, warning, info, debug, trace
_CUT_OFF_AFTER_S = 5.0   # after the drain deadline's aborts, how long streams may take to end before being cut


@engine_options
def serve_command(
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 serves every interface.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 = any free port (printed when ready).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        help="Require `Authorization: Bearer KEY` on every /v1 route.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        help="The model id clients name; default: --model as given, or minillm-demo.")] = None,
    max_body_bytes: Annotated[int, typer.Option(help="Larger request bodies get 413.")] = DEFAULT_MAX_BODY_BYTES,
    max_waiting: Annotated[int, typer.Option(
        help="New requests get 503 (Retry-After) while this many sequences (prompts x n) wait for the engine; a "
             "request of more sequences than this alone gets 400.")] = DEFAULT_MAX_WAITING,
    drain_timeout: Annotated[float, typer.Option(
        help="Seconds requests in flight may run on after SIGTERM/SIGINT before they are aborted.")]
    = DEFAULT_DRAIN_TIMEOUT_S,
    log_level: Annotated[str, typer.Option(metavar="LEVEL", help=f"uvicorn log level: {'|'.join(LOG_LEVELS)}.")]
    = "info",
    *, engine: EngineFlags,
) -> None:
    """OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health,
    /metrics."""
    log_level = _check_server_flags(log_level, drain_timeout)
    cfg, sampling = engine.load()
    try:
        settings = ServerSettings(served_model_name or cfg.model.model or DEMO_MODEL_NAME, host, port, api_key,
                                  max_body_bytes, max_waiting, drain_timeout).validate()
    except ValueError as e:
        fail(str(e))
    sock = _bind(host, port)
    llm = build_llm(cfg, serving=True)
    app = create_app(llm, sampling, settings)
    freeze_heap()   # a serving process: no full collection pauses (the modules above included)
    bound = sock.getsockname()[1]
    ready = (f"minillm serve: ready on http://{_url_host(host)}:{bound} (model {settings.served_model_name!r}, "
             f"max_model_len {llm.max_model_len}; {_implementations()})")
    # uvicorn's own deadline is a backstop: at drain_timeout the engine aborts what still runs, so streams end
    # with a final chunk and connections close by themselves; only a client that never reads is cut off.
    config = uvicorn_config(app, settings, log_level, graceful_shutdown_s=drain_timeout + _CUT_OFF_AFTER_S)
    engine = app.state.server.engine
    server = _Server(config, on_signal=lambda: engine.call_soon(engine.begin_drain, drain_timeout), ready=ready)
    engine.on_fatal = lambda: setattr(server, "should_exit", True)   # the engine process died: stop serving
    server.run(sockets=[sock])
    llm.close()
    if engine.fatal is not None:
        fail(f"{engine.fatal}; every request in flight got an error", code=1)
    raise typer.Exit(130 if server.force_exit else 0)


serve_command._epilog = ("Exit status: 0 stopped by SIGTERM or SIGINT (requests still running at --drain-timeout "
                         "are aborted, each with its final chunk); 1 an unexpected error; 2 usage or configuration "
                         "error, a port that cannot be bound or a model that cannot be loaded, before any request "
                         "is accepted; 130 a second SIGINT cut the drain short.")


def _check_server_flags(log_level: str, drain_timeout: float) -> str:
    """Refuse the server's own bad flags before the model loads (exit 2); returns the log level uvicorn takes."""
    level = log_level.strip().lower()
    if level not in LOG_LEVELS:
        fail(f"--log-level={short_repr(log_level)} is not allowed: one of {', '.join(LOG_LEVELS)}")
    # A bound, not only finiteness: timers overflow long before float does (1e300 s).
    if not (math.isfinite(drain_timeout) and 0 <= drain_timeout <= MAX_DRAIN_TIMEOUT_S):
        fail(f"--drain-timeout={drain_timeout} is not allowed: seconds in [0, {MAX_DRAIN_TIMEOUT_S}]")
    return level


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def _implementations() -> str:
    """What uvicorn's "auto" picks: uvloop and httptools when installed (less event-loop CPU per streamed chunk, so
    less competition with the engine thread for the GIL), else asyncio and h11."""
    have = {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}
    return f"{'uvloop' if have['uvloop'] else 'asyncio'} + {'httptools' if have['httptools'] else 'h11'}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Server(uvicorn.Server):
    """uvicorn.Server with minillm's signal handling and ready line."""

    def __init__(self, config: uvicorn.Config, on_signal, ready: str):
        super().__init__(config)
        self.on_signal, self.ready = on_signal, ready

    @contextlib.contextmanager
    def capture_signals(self):
        # NOTE: uvicorn's own handler re-raises the signal after its graceful shutdown, so the process would die by
        # SIGTERM; a server that drained cleanly exits 0 instead.
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, sig, frame) -> None:
        self.on_signal()   # new requests get 503 from now on
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            typer.echo(self.ready, err=True)
