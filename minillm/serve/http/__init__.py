"""`minillm serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of one engine loop thread.

    command.py      the CLI command: flags -> engine + ServerSettings -> uvicorn (signals drain, exit 0)
    app.py          the FastAPI app: routes, lifespan, per-request flow (validate -> enqueue -> await deltas)
    engine_loop.py  the thread that owns the engine and steps for everyone; deltas go back once per step
    protocol.py     request bodies (pydantic, strict) -> prompts + SamplingParams
    formatting.py   OpenAI response, stream-chunk, logprobs and usage shapes
    errors.py       OpenAI-shaped errors, body-size limit and API-key check (one ASGI middleware)
    metrics.py      Prometheus gauges, counters and histograms
"""
