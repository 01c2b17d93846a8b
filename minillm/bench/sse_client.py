"""A lean streaming HTTP/1.1 client for the HTTP replay (minillm.bench.http_load): POST a JSON body, read the
answer as server-sent events, each stamped with time.perf_counter() when the bytes that completed it came off
the socket.

Why not httpx for the timed requests: its request building and its chunk path (connection pool locks, anyio, one
async generator per layer) cost the client a millisecond or more per request on a busy event loop, and the
arrival stamp could only be taken after all of it, so the client's own work was counted as the server's TTFT.
Here the stamp is taken first thing in data_received, and h11 (the HTTP/1.1 state machine httpx itself runs on)
does the parsing, so any server that speaks HTTP/1.1 (chunked, Content-Length or close-delimited) works.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11


class StreamError(Exception):
    """The request failed before its answer ended: connection refused or lost, a malformed response."""


@dataclass
class Answer:
    status: int = 0
    sent: float = 0.0                             # time.perf_counter() once the request was handed to the socket
    events: list = field(default_factory=list)   # (arrival time, data of one SSE event as bytes), in order
    body: bytes = b""                             # the body of an answer that is not 200


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self):
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport = None
        self.lost = False
        self._answer: Answer | None = None
        self._done: asyncio.Future | None = None
        self._pending = b""          # SSE bytes after the last complete event
        self._got_bytes = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = True
        try:
            self.h11.receive_data(b"")
        except RuntimeError:   # h11 had already seen the end of the stream
            pass
        if self._done is not None and not self._done.done():
            try:   # a close-delimited body ends here
                self._read(time.perf_counter())
            except h11.RemoteProtocolError:
                pass
            if not self._done.done():
                why = f": {exc}" if exc else ""
                self._done.set_exception(StreamError(f"connection closed by the server{why}"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()   # before any parsing: the client's own work is not counted as latency
        self._got_bytes = True
        self.h11.receive_data(data)
        try:
            self._read(now)
        except h11.RemoteProtocolError as e:
            if not self._done.done():
                self._done.set_exception(StreamError(f"malformed response: {e}"))
            self.transport.close()

    def _read(self, now: float) -> None:
        answer = self._answer
        while self._done is not None and not self._done.done():
            event = self.h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Response):
                answer.status = event.status_code
            elif isinstance(event, h11.Data):
                if answer.status == 200:
                    self._feed(bytes(event.data), now)
                else:
                    answer.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self._done.set_result(answer)
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("the connection closed before the answer ended")

    def _feed(self, data: bytes, now: float) -> None:
        """Split SSE events (a blank line ends one) and keep their `data:` payloads, stamped `now`."""
        buf = (self._pending + data).replace(b"\r\n", b"\n")
        *complete, self._pending = buf.split(b"\n\n")
        for event in complete:
            payload = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if payload:
                self._answer.events.append((now, b"\n".join(payload)))

    def start(self, request: bytes) -> asyncio.Future:
        self._answer, self._pending, self._got_bytes = Answer(), b"", False
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        self._answer.sent = time.perf_counter()
        return self._done

    @property
    def reusable(self) -> bool:
        return (not self.lost and self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE)


class SSEClient:
    """POSTs to one server over a pool of keep-alive connections (a new one when every open one is busy)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 30.0):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host, self.prefix = url.hostname, url.path.rstrip("/")
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.authority = url.netloc.rsplit("@", 1)[-1]
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._idle: list[_Connection] = []

    async def open(self, count: int) -> None:
        """Open `count` idle connections now, so the timed requests find them ready."""
        conns = await asyncio.gather(*(self._connect() for _ in range(count)))
        self._idle.extend(conns)

    def request_bytes(self, conn: _Connection, path: str, body: bytes) -> bytes:
        headers = [("Host", self.authority), ("Content-Type", "application/json"),
                   ("Accept", "text/event-stream"), ("Content-Length", str(len(body)))]
        return b"".join([conn.h11.send(h11.Request(method="POST", target=self.prefix + path, headers=headers)),
                         conn.h11.send(h11.Data(data=body)), conn.h11.send(h11.EndOfMessage())])

    async def post(self, path: str, body: bytes) -> Answer:
        """The answer (status, SSE events or the error body); StreamError if the request failed. A kept-alive
        connection the server closed before answering a byte is retried once on a new one."""
        conn, reused = await self._acquire()
        try:
            try:
                answer = await asyncio.wait_for(conn.start(self.request_bytes(conn, path, body)), self.timeout_s)
            except StreamError:
                if not (reused and not conn._got_bytes):
                    raise
                conn = await self._connect()
                answer = await asyncio.wait_for(conn.start(self.request_bytes(conn, path, body)), self.timeout_s)
        except asyncio.TimeoutError:
            conn.transport.close()
            raise StreamError(f"no complete answer within {self.timeout_s:g} s") from None
        except BaseException:
            conn.transport.close()
            raise
        self._release(conn)
        return answer

    async def _acquire(self) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()   # the most recently used: the least likely to have timed out
            if not conn.lost:
                return conn, True
        return await self._connect(), False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl),
                                             self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise StreamError(f"cannot connect to {self.host}:{self.port}: {type(e).__name__}: {e}") from None
        return conn

    def _release(self, conn: _Connection) -> None:
        if conn.reusable:
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.transport.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()
