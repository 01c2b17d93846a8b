"""The FastAPI app of `minillm serve`: routes, lifespan, and one request's way through the server.

A request is parsed and validated (pydantic, then SamplingParams), its text prompts are tokenized on a small
thread pool (so neither the event loop nor the engine thread tokenizes; token-id prompts are only checked, in
place), each prompt is handed to the engine thread, and the handler awaits its asyncio queue of StepOutputs:
streamed as SSE chunks, or gathered into one response.
A client that goes away, or a handler cancelled at the end of a drain, aborts its engine requests at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from minillm.serve.http.engine_loop import AsyncEngine, EngineFailure, Overloaded
from minillm.serve.http.errors import APIError, Gate, error_body, install_error_handlers
from minillm.serve.http.formatting import DONE, Shape, StreamFormatter, TokenText, sse
from minillm.serve.http.metrics import CONTENT_TYPE, ServerMetrics
from minillm.serve.http.protocol import (ChatRequest, CompletionRequest, check_request, constrained,
                                         enable_thinking, messages_json, prompt_error, sampling_params,
                                         spec_api_error, structured_spec, tool_setup, with_room)
from minillm.serve.http.settings import RETRY_AFTER_S, ServerSettings

PREPARE_THREADS = 2
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _EngineStream(StreamingResponse):
    """A streamed response that runs `on_close` however it ends: finished, client gone, or cancelled (also when
    it is cancelled before its body iterator ever started, when the iterator's own cleanup would not run)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers=_SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class OpenAIServer:
    def __init__(self, llm, defaults: dict, settings: ServerSettings):
        self.llm, self.defaults, self.settings = llm, dict(defaults), settings
        core = llm.engine.core
        replicas = (llm.config.parallel.data_parallel_size, core.replica_stats) \
            if llm.config.parallel.data_parallel_size > 1 else None
        self.metrics = ServerMetrics(lambda: self.engine.snapshot(), replicas)
        self.engine = AsyncEngine(llm, self.metrics, settings.max_waiting)
        self.token_text = TokenText(llm.tokenizer)
        self.created = int(time.time())
        # Tokenizing and chat-template rendering run here, off the event loop: a long prompt must not stall every
        # other stream and /health. A few threads suffice (the tokenizer releases the GIL while it works).
        self.prepare_pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="minillm-prepare")

    def model_card(self) -> dict:
        return {"id": self.settings.served_model_name, "object": "model", "created": self.created,
                "owned_by": "minillm", "root": self.llm.config.model.model, "parent": None,
                "max_model_len": self.llm.max_model_len}

    # ---- one request ------------------------------------------------------------------------------------------
    async def generate(self, request: Request, req, chat: bool) -> Response:
        arrival = time.perf_counter()
        if req.model is not None and req.model != self.settings.served_model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                           f"{self.settings.served_model_name!r}", param="model", code="model_not_found")
        check_request(req)
        params, given = sampling_params(req, self.defaults)
        thinking = enable_thinking(req) if chat else None
        spec = structured_spec(req)
        tools = tool_names = None
        if chat:
            tools, tool_names, forced = tool_setup(req)
            spec = forced or spec
        if spec is not None:
            params = constrained(params, spec, req)
            await self._compile(spec)
        prompts = [messages_json(req)] if chat else _prompt_list(req.prompt)
        self._check_capacity(len(prompts), params.n)
        prepared = await self._prepare_all(prompts, params, given, thinking, req, tools, chat)
        self._check_capacity(len(prompts), params.n)   # the queue may have grown while we tokenized
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        rids = [rid] if len(prepared) == 1 else [f"{rid}-{i}" for i in range(len(prepared))]
        queue: asyncio.Queue = asyncio.Queue()
        await self._admit(rids, prepared, req, given, queue, arrival)
        shape = Shape(chat, rid, int(time.time()), self.settings.served_model_name, params.n,
                      params.logprobs is not None, bool(req.return_token_ids),
                      bool(req.stream_options and req.stream_options.include_usage), self.token_text,
                      tool_names)
        if req.stream:
            formatter = StreamFormatter(shape, {r: ids for r, (ids, _) in zip(rids, prepared)})
            return _EngineStream(self._sse(formatter, queue, len(rids)), lambda: self._abort(rids))
        outputs = await self._gather(request, queue, rids)
        if outputs is None:   # the client is gone; nobody reads this
            return Response(status_code=499)
        return JSONResponse(shape.response([outputs[r] for r in rids]))

    def _check_capacity(self, num_prompts: int, n: int) -> None:
        try:
            self.engine.check_capacity(num_prompts * n)
        except Overloaded as e:
            raise APIError(503, str(e), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:
            param = "n" if n > self.engine.max_waiting or num_prompts == 1 else "prompt"
            raise APIError(400, str(e), param=param, code="too_many_sequences") from None

    async def _compile(self, spec) -> None:
        """Compile the request's grammar on the compile threads while this loop keeps serving; a spec that is
        refused, or does not compile within structured.compile_timeout_s, is a 400."""
        limit = self.llm.config.structured.compile_timeout_s
        try:
            job = await asyncio.to_thread(self.llm.compile_grammar, spec)   # the first one builds the vocabulary
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), limit)
        except asyncio.TimeoutError:
            raise APIError(400, f"{spec.param} did not compile within {limit:g} s (structured.compile_timeout_s); "
                           "simplify it", param=spec.param.split(".", 1)[0]) from None
        except ValueError as e:   # SpecError
            raise spec_api_error(e) from None

    async def _prepare_all(self, prompts, params, given: bool, thinking, req, tools, chat: bool) -> list:
        """Every prompt prepared: text and chat on the prepare threads (the tokenizer releases the GIL), token ids
        here. Checking ids is plain Python that holds the GIL on any thread, so a pool thread would only add two
        thread hand-offs to the request's TTFT."""
        if not chat and not any(isinstance(p, str) for p in prompts):
            return [self._prepare(p, params, given, thinking, req, tools) for p in prompts]
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(self.prepare_pool, self._prepare, p, params, given,
                                                           thinking, req, tools) for p in prompts))

    def _prepare(self, prompt, params, given: bool, thinking, req, tools=None) -> tuple[list[int], object]:
        """Tokenize and check one prompt; an unset max_tokens becomes what max_model_len leaves (capped by the
        default). Returns (prompt ids, its SamplingParams)."""
        check = params if given else dataclasses.replace(params, max_tokens=1, min_tokens=0)
        try:
            ids = self.llm.prepare_prompt(prompt, check, thinking, tools)
        except ValueError as e:
            raise prompt_error(str(e), req, given) from None
        return ids, (params if given else with_room(params, len(ids), self.llm.max_model_len, req))

    async def _admit(self, rids, prepared, req, given: bool, queue, arrival: float) -> None:
        """Hand every prompt to the engine at once (one admission round trip, however many prompts); if the engine
        refuses one, the others are aborted and the refusal is the answer. Cancelled (the client left): each add
        aborts its own request."""
        adds = [self.engine.add(r, ids, params, req.priority or 0, queue, arrival)
                for r, (ids, params) in zip(rids, prepared)]
        results = await asyncio.gather(*adds, return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            self._abort(rids)
            if isinstance(errors[0], ValueError):   # e.g. more KV blocks than the pool has
                raise prompt_error(str(errors[0]), req, given) from None
            raise errors[0]

    def _abort(self, rids) -> None:
        for r in rids:
            self.engine.abort(r)

    async def _sse(self, formatter: StreamFormatter, queue: asyncio.Queue, num_requests: int):
        first = formatter.start()
        if first:
            yield first
        finished = 0
        while finished < num_requests:
            # everything that arrived since the last write goes out in one write
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            parts = []
            for item in items:
                if isinstance(item, EngineFailure):
                    yield "".join(parts) + sse(error_body(500, str(item))) + DONE
                    return
                parts.append(formatter.on_output(item))
                finished += item.output is not None
            yield "".join(parts)
        yield formatter.end()

    async def _gather(self, request: Request, queue: asyncio.Queue, rids: list[str]) -> dict | None:
        """Every prompt's RequestOutput, or None if the client disconnected first (its requests are aborted)."""
        collect = asyncio.ensure_future(_collect(queue, len(rids)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                self._abort(rids)
        return collect.result() if collect in done else None


async def _collect(queue: asyncio.Queue, num_requests: int) -> dict:
    outputs = {}
    while len(outputs) < num_requests:
        item = await queue.get()
        if isinstance(item, EngineFailure):
            raise APIError(500, str(item))
        if item.output is not None:
            outputs[item.request_id] = item.output
    return outputs


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _prompt_list(prompt) -> list:
    """A completions prompt -> one engine prompt per entry (a string, or a list of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def create_app(llm, defaults: dict, settings: ServerSettings) -> FastAPI:
    server = OpenAIServer(llm, defaults, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await server.engine.stop(timeout=max(5.0, settings.drain_timeout_s))
        server.prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    install_error_handlers(app)
    app.add_middleware(Gate, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.engine.running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != settings.served_model_name:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.generate(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await server.generate(request, body, chat=True)

    return app
