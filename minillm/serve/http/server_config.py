"""The uvicorn configuration of `minillm serve`, with a deadline for a request's headers.

uvicorn times out an idle keep-alive connection, but not one that is sending its headers: a client that trickles
a header byte every few seconds (slowloris) holds its connection, and a file descriptor, for as long as it likes,
and a few thousand such clients exhaust the server. The protocol below closes a connection whose request headers
are not complete within header_timeout_s of its opening, or of the previous response's end.
"""
from __future__ import annotations

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from minillm.serve.http.settings import ServerSettings


def header_deadline_protocol(base: type, timeout_s: float) -> type:
    """`base` (uvicorn's h11 or httptools protocol) with the header deadline. Both set `self.cycle` to a new
    request-response cycle once a request's headers are parsed, so a changed cycle means the headers arrived."""

    class HeaderDeadline(base):
        _deadline = None
        _armed_cycle = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._armed_cycle:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._armed_cycle = self.cycle
            self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is self._armed_cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def uvicorn_config(app, settings: ServerSettings, log_level: str, graceful_shutdown_s: float) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=graceful_shutdown_s,
                          http=header_deadline_protocol(AutoHTTPProtocol, settings.header_timeout_s))
