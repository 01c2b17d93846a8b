"""SIGINT and SIGTERM as a request to stop, checked between engine steps, for generate and serve-stdin.

A handler only records the signal, so it never lands inside a step and the engine stays consistent for the
aborts that follow: the caller aborts every request in flight, writes their final lines and exits with
128 + the signal number (130 for SIGINT, 143 for SIGTERM). A second signal of either kind while that happens
falls back to the default action (KeyboardInterrupt for SIGINT, termination for SIGTERM), so a stuck shutdown
can still be cut short.
"""
from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """`with StopSignals() as stop:` ... `if stop.requested:` ... `stop.exit_code`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> "StopSignals":
        # Handlers can only be installed from the main thread; elsewhere (a server thread, a test worker)
        # the caller's own signal handling stays in charge.
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        return False

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        for sig in SIGNALS:   # the next one takes the default way out
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
