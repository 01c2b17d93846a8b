"""minillm.bench.sse_client, the replay's streaming client, against small servers written here: SSE events split
across writes and chunk boundaries, keep-alive reuse, error answers, a server that closes mid-stream or a
kept-alive connection, and a port nobody listens on."""
import asyncio
import socket

import pytest

from minillm.bench.sse_client import SSEClient, StreamError

SSE_HEADERS = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return head + await reader.readexactly(length)


async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_events_split_anywhere_are_reassembled_and_the_connection_is_reused():
    requests, connections = [], []

    async def handler(reader, writer):
        connections.append(writer)
        for _ in range(2):
            requests.append(await _read_request(reader))
            writer.write(SSE_HEADERS + _chunk(b'data: {"a": 1}\r\n\r\ndata: {"b":'))
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(_chunk(b' 2}\n') + _chunk(b"\ndata: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def main():
        server, url = await _serve(handler)
        client = SSEClient(url + "/prefix/")
        answers = [await client.post("/v1/completions", b'{"x": 1}') for _ in range(2)]
        client.close()
        server.close()
        return answers

    answers = asyncio.run(main())
    assert len(connections) == 1   # the second request went over the kept-alive connection
    assert requests[0].startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n") and requests[0].endswith(b'{"x": 1}')
    for a in answers:
        assert a.status == 200 and [d for _, d in a.events] == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
        (t1, _), (t2, _), (t3, _) = a.events
        assert 0 < a.sent < t1 < t2 == t3   # each stamped when the bytes completing it arrived


def test_an_error_answer_keeps_its_status_and_body():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 11\r\n\r\nbad request")
        await writer.drain()

    async def main():
        server, url = await _serve(handler)
        answer = await SSEClient(url).post("/v1/completions", b"{}")
        server.close()
        return answer

    answer = asyncio.run(main())
    assert (answer.status, answer.body, answer.events) == (400, b"bad request", [])


def test_a_stream_cut_short_is_an_error():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(SSE_HEADERS + _chunk(b"data: {}\n\n"))
        await writer.drain()
        writer.close()

    async def main():
        server, url = await _serve(handler)
        try:
            await SSEClient(url).post("/v1/completions", b"{}")
        finally:
            server.close()

    with pytest.raises(StreamError, match="closed"):
        asyncio.run(main())


def test_a_kept_alive_connection_closed_by_the_server_is_retried_once_on_a_new_one():
    served = []

    async def handler(reader, writer):
        served.append(writer)
        await _read_request(reader)
        if len(served) == 1:   # answer the first request, then drop the connection without a word
            writer.write(SSE_HEADERS + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            await reader.read(1)   # the second request's bytes, unanswered
        else:
            writer.write(SSE_HEADERS + _chunk(b"data: 2\n\n") + b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def main():
        server, url = await _serve(handler)
        client = SSEClient(url)
        await client.post("/v1/completions", b"{}")
        answer = await client.post("/v1/completions", b"{}")
        server.close()
        return answer

    answer = asyncio.run(main())
    assert len(served) == 2 and [d for _, d in answer.events] == [b"2"]


def test_nobody_listening_is_a_stream_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StreamError, match="cannot connect"):
        asyncio.run(SSEClient(f"http://127.0.0.1:{port}").post("/v1/completions", b"{}"))
    with pytest.raises(ValueError, match="not an http"):
        SSEClient("ftp://x")


def test_the_replay_sends_at_the_due_time_never_before():
    import time

    from minillm.bench.http_load import _sleep_until

    async def main():
        lags = []
        for delay in (0.0005, 0.003, 0.011):
            due = time.perf_counter() + delay
            await _sleep_until(due)
            lags.append(time.perf_counter() - due)
        return lags

    assert all(lag >= 0 for lag in asyncio.run(main()))
