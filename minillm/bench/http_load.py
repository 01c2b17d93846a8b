"""`minillm latency-sweep --target URL`: the online workload replayed against any OpenAI-compatible server.

Open loop, like the in-process sweep (minillm.bench.latency): each request is sent when it is due and its clock
starts then, even if the client was late, so queueing shows in TTFT. Requests go to /v1/completions with the
prompt as token ids, streamed, and each SSE chunk is timestamped as it arrives. Tokens per chunk come from the
chunk's `token_ids` (vLLM's `return_token_ids`, which minillm serves too); a server without them is counted one
token per non-empty chunk, and its usage totals are recorded beside. The rows have the in-process rows' keys, plus
`transport: "http"`, the target and the server's own name for itself.

The client must not add its own lag to what it reports as the server's: the timed requests go through
minillm.bench.sse_client (bodies encoded before the replay, connections opened before it, each chunk stamped as
its bytes come off the socket), and each is sent on its due time to within a fraction of a millisecond (the event
loop's timers alone wake up to a millisecond late, and that would count in TTFT). Each row says how late the
client was (client_send_lag_p50_s, _max_s). httpx does the untimed rest (model card, warm-up, /metrics).
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import random
import time

import httpx
import msgspec

from minillm.bench.offline import WARMUP_MAX_TOKENS, WARMUP_PROMPT_LEN, WARMUP_REQUESTS, progress_bar
from minillm.bench.sse_client import SSEClient, StreamError
from minillm.bench.stats import RequestTimeline, latency_summary, percentile
from minillm.bench.workloads import Workload

_START_LEAD_S = 0.05   # the first arrival is this far after the replay starts, so it is never already late
_TIMEOUT = httpx.Timeout(600.0, connect=30.0)
_SPIN_S = 0.002        # the last stretch before a request is due is waited out by yielding, not by a timer
_OPEN_CONNECTIONS = 16   # opened before each replay (more are opened when that many streams are in flight)


@dataclasses.dataclass
class _Outcome:
    timeline: RequestTimeline
    chunks: int = 0
    usage_tokens: int | None = None
    error: str | None = None
    raw: list = dataclasses.field(default_factory=list)   # (arrival time, SSE data) until the replay is over
    send_lag: float = 0.0                                  # how late after its due time the request was sent


def _body(model: str, prompt: list[int], max_tokens: int, temperature: float, stream: bool) -> dict:
    # Every sampling field the in-process replay sets (plain temperature sampling, minillm/bench/offline.py), so a
    # server's own defaults (top_p 0.9 in the config's sampling section) cannot make its sampler do other work.
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "ignore_eos": True, "stream": stream, "return_token_ids": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _stream_one(client: SSEClient, body: bytes, out: _Outcome) -> _Outcome:
    out.send_lag = time.perf_counter() - out.timeline.arrival   # until the request is written, below
    try:
        # NOTE: the client's own work per chunk delays the next chunk's timestamp, so events are only stamped and
        # kept while the replay runs, and parsed after it.
        answer = await client.post("/v1/completions", body)
    except StreamError as e:
        out.error = f"StreamError: {e}"
        return out
    out.send_lag = answer.sent - out.timeline.arrival
    if answer.status != 200:
        out.error = f"HTTP {answer.status}: {answer.body[:300]!r}"
    else:
        out.raw = answer.events
    return out


def _parse_chunks(out: _Outcome) -> None:
    try:
        for now, data in out.raw:
            if data != b"[DONE]":
                _read_chunk(json.loads(data), now, out)
    except json.JSONDecodeError as e:
        out.error = out.error or f"JSONDecodeError: {e}"
    out.raw = []


def _read_chunk(chunk: dict, now: float, out: _Outcome) -> None:
    if "error" in chunk:
        out.error = str(chunk["error"])
        return
    if chunk.get("usage"):
        out.usage_tokens = chunk["usage"].get("completion_tokens")
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else int(bool(choice.get("text")))
        if n:
            out.chunks += 1
            out.timeline.token_times.extend([now] * n)


async def _replay(target: str, model: str, workload: Workload, rate: float, time_scale: float,
                  show_progress: bool):
    """One open-loop replay. The cycle collector is off meanwhile (the workload alone is ~1M objects, and a full
    collection would land in some token's measured latency, the client's pause mistaken for the server's)."""
    bodies = [msgspec.json.encode(_body(model, prompt, max_tokens, workload.temperature, stream=True))
              for prompt, max_tokens in zip(workload.prompts, workload.max_tokens)]
    client = SSEClient(target)
    try:
        await client.open(min(_OPEN_CONNECTIONS, len(bodies)))
    except StreamError as e:
        raise RuntimeError(str(e)) from None
    gc.collect()
    gc.disable()
    try:
        outcomes = await _replay_open_loop(client, bodies, workload, rate, time_scale, show_progress)
    finally:
        gc.enable()
        client.close()
    for out in outcomes:
        _parse_chunks(out)
    return outcomes


async def _sleep_until(due: float) -> None:
    """Return at `due` (time.perf_counter()), within microseconds rather than the millisecond by which the event
    loop's timers may be late: the last _SPIN_S yields to the loop until then (streams are read meanwhile)."""
    while True:
        left = due - time.perf_counter()
        if left <= 0:
            return
        await asyncio.sleep(left - _SPIN_S if left > 2 * _SPIN_S else 0)


async def _replay_open_loop(client: SSEClient, bodies: list[bytes], workload: Workload, rate: float,
                            time_scale: float, show_progress: bool):
    arrivals = [a * time_scale for a in workload.arrivals(rate)]
    tasks = []
    with progress_bar(show_progress) as bar:
        task = bar.add_task(f"{rate:g} req/s (http)", total=workload.num_requests, tokens=0) if bar else None
        t0 = time.perf_counter() + _START_LEAD_S
        for i, body in enumerate(bodies):
            due = t0 + arrivals[i]
            await _sleep_until(due)
            out = _Outcome(RequestTimeline(arrival=due))
            t = asyncio.create_task(_stream_one(client, body, out))
            if bar:
                t.add_done_callback(lambda _: bar.advance(task))
            tasks.append(t)
        return await asyncio.gather(*tasks)


async def _warm_up(client, model: str, workload: Workload) -> float:
    """As minillm.bench.offline.warm_up, over HTTP: short requests on prompts of their own."""
    rng = random.Random(12345)
    top = workload.params.get("max_token_id", 10000)
    length = max(1, min(WARMUP_PROMPT_LEN, workload.max_model_len - WARMUP_MAX_TOKENS))
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(client.post("/v1/completions", json=_body(
        model, [rng.randint(0, top) for _ in range(length)], WARMUP_MAX_TOKENS, 0.6, stream=False))
        for _ in range(WARMUP_REQUESTS)))
    bad = [r for r in replies if r.status_code != 200]
    if bad:
        raise RuntimeError(f"warm-up request refused: HTTP {bad[0].status_code}: {bad[0].text[:300]}")
    return time.perf_counter() - t0


async def _server(client, workload: Workload) -> dict:
    """The served model (id, owned_by, max_model_len if the server says); refuse a workload it cannot hold."""
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {client.base_url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200 or not r.json().get("data"):
        raise RuntimeError(f"{client.base_url}/v1/models answered HTTP {r.status_code}: {r.text[:300]}")
    card = r.json()["data"][0]
    need = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens))
    if isinstance(card.get("max_model_len"), int) and card["max_model_len"] < need:
        raise RuntimeError(f"the server's max_model_len is {card['max_model_len']}; the workload needs {need}")
    return card


def _row(outcomes: list[_Outcome], workload: Workload, rate: float) -> dict:
    failed = [o.error for o in outcomes if o.error]
    summary = latency_summary([o.timeline for o in outcomes])
    usage = [o.usage_tokens for o in outcomes]
    problems = []
    if failed:
        problems.append(f"{len(failed)} request(s) failed, first: {failed[0]}")
    if summary["output_tokens"] != workload.output_tokens:
        problems.append(f"{summary['output_tokens']} output tokens seen in chunks, expected {workload.output_tokens}")
    lags = [o.send_lag for o in outcomes]
    return {"rate": rate, "requests_failed": len(failed), "chunks": sum(o.chunks for o in outcomes),
            "usage_output_tokens": None if None in usage else sum(usage), "problems": problems,
            "client_send_lag_p50_s": percentile(lags, 50), "client_send_lag_max_s": max(lags) if lags else None,
            **summary}


async def _sweep(target: str, workload: Workload, rates, time_scale, show_progress, label, cfg, append) -> None:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(base_url=target.rstrip("/"), timeout=_TIMEOUT, limits=limits) as client:
        card = await _server(client, workload)
        warmup_s = await _warm_up(client, card["id"], workload)
        for i, rate in enumerate(rates):
            # salted as in-process: the previous rate's prompts are still in the server's prefix cache
            before = await _server_latency(client)
            outcomes = await _replay(target, card["id"], workload.salted(i), rate, time_scale, show_progress)
            server = _server_means(before, await _server_latency(client))
            append({"kind": "latency", "engine": card.get("owned_by", "unknown"), "transport": "http",
                    "target": target, "served_model": card["id"], "label": label, "time_scale": time_scale,
                    "budget": cfg.scheduler.max_num_batched_tokens if cfg else None,
                    "chunked": cfg.scheduler.enable_chunked_prefill if cfg else None,
                    "attention_mode": cfg.runtime.attention_mode if cfg else None,
                    "config": dataclasses.asdict(cfg) if cfg else {}, "workload": workload.summary(),
                    "load_s": None, "warmup_s": warmup_s, **server, **_row(outcomes, workload, rate)})


_SERVER_SERIES = {"ttft": "minillm_time_to_first_token_seconds", "itl": "minillm_inter_token_latency_seconds",
                  "admission": "minillm_admission_seconds"}


async def _server_latency(client) -> dict | None:
    """The server's own TTFT and ITL histogram sums and counts (its /metrics), or None if it has none."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    values = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in _SERVER_SERIES.values():
            values[name] = float(value)
    return values


def _server_means(before: dict | None, after: dict | None) -> dict:
    """Mean TTFT and ITL over one replay as the server measured them (when its engine loop saw the tokens),
    next to the client's percentiles: what the server adds is told apart from what the client and HTTP add. And
    minillm's admission time (arrival to the engine taking the request): the server's hops before engine work."""
    out = {}
    for key, series in _SERVER_SERIES.items():
        if not before or not after or f"{series}_count" not in after:
            out[f"server_{key}_mean_s"] = None
            continue
        n = after[f"{series}_count"] - before.get(f"{series}_count", 0.0)
        total = after[f"{series}_sum"] - before.get(f"{series}_sum", 0.0)
        out[f"server_{key}_mean_s"] = total / n if n > 0 else None
    return out


def sweep_target(target: str, workload: Workload, rates: list[float], time_scale: float, show_progress: bool,
                 named: list, append) -> tuple[list[dict], list[str]]:
    """One results row per rate, each passed through `append` (which stamps and writes it) as soon as it exists.
    `named`: [(name, EngineConfig)] the server was started with, when the caller names it (--configs NAME); the
    rows then carry that config, else label "http" and no config. Returns (rows, problems)."""
    label, cfg = named[0] if named else ("http", None)
    lines: list[dict] = []
    try:
        _run(_sweep(target, workload, rates, time_scale, show_progress, label, cfg,
                    lambda row: lines.append(append(row))))
    except (RuntimeError, httpx.HTTPError) as e:   # server unreachable, warm-up refused, ...
        return lines, [f"{label} against {target}: {type(e).__name__}: {e}"]
    return lines, [f"{label} at {line['rate']:g} req/s: {p}" for line in lines for p in line["problems"]]


def _run(coro):
    """uvloop's event loop when installed (less client CPU per chunk, as for the server), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
