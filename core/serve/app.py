"""The OpenAI-compatible HTTP app (FastAPI) over one :class:`~core.engine.Engine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template),
``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /health`` (503 until the engine is loaded
and warmed up), ``GET /metrics`` (Prometheus). Streaming answers are server-sent events
(``data: {json}`` chunks, then ``data: [DONE]``). The engine's events reach the request's
coroutine through an asyncio queue (the sink runs on the engine's thread and hands each event to
the event loop).

Errors: a malformed or unsupported request gets 400 with an OpenAI error body and nothing is
queued; a full queue 429 with ``Retry-After``; a missing or wrong API key 401; an unknown route
or model id 404 (a wrong method 405) and an unexpected failure 500, with an OpenAI error body
too; the server keeps serving after each. A client that disconnects has its request aborted: its
slot is free before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from core.engine import Engine, EngineClosedError, Event, QueueFullError
from core.engine.request import Request as EngineRequest
from core.errors import USER_ERRORS, RequestError
from core.models.model import ModelError
from core.serve import openai_api as api
from core.serve.metrics import Metrics

log = logging.getLogger("lockstep")

#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1


class Server:
    """What the routes share: the engine once loaded, the served name, the key, the metrics.

    Args:
        load: makes the started engine (run on a thread at startup; /health is 503 until then).
        served: the model name clients pass as ``model``.
        api_key: when set, ``Authorization: Bearer <key>`` is required on /v1 routes.
    """

    def __init__(self, load: Callable[[], Engine], served: str, api_key: str | None = None):
        self.load, self.served, self.api_key = load, served, api_key
        self.engine: Engine | None = None
        self.failed: str | None = None
        self.error: BaseException | None = None  # why loading failed (serve() exits with it)
        self.on_failure: Callable[[], None] | None = None  # told when loading fails (serve() stops uvicorn)
        self.metrics = Metrics()

    def start_loading(self) -> threading.Thread:
        """Load the engine on a thread (the app answers /health 503 meanwhile)."""
        def run() -> None:
            try:
                engine = self.load()
            except Exception as exc:  # noqa: BLE001 - reported by /health, and by serve() as it exits
                if isinstance(exc, USER_ERRORS):
                    log.error("loading the model failed: %s", exc)
                else:
                    log.exception("loading the model failed")
                self.failed, self.error = str(exc), exc
                if self.on_failure is not None:
                    self.on_failure()
                return
            self.metrics.watch(engine)
            self.engine = engine
        thread = threading.Thread(target=run, name="lockstep-load", daemon=True)
        thread.start()
        return thread


def _error(exc: api.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def make_app(server: Server) -> FastAPI:
    """The FastAPI app of ``server`` (loading starts with the app's lifespan)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start_loading()
        yield
        if server.engine is not None:
            await asyncio.to_thread(server.engine.shutdown, 30)

    app = FastAPI(title="lockstep", lifespan=lifespan)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:  # an unknown route or method
        message = (f"no route {request.method} {request.url.path}; this server answers POST /v1/completions, "
                   "POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics"
                   if exc.status_code in (404, 405) else str(exc.detail))
        return _error(api.APIError(message, status=exc.status_code, headers=getattr(exc, "headers", None),
                                   kind="invalid_request_error" if exc.status_code < 500 else "server_error"))

    @app.exception_handler(Exception)  # Starlette re-raises it after this answer: uvicorn logs the traceback
    async def server_error(request: Request, exc: Exception) -> Response:  # a bug: still an OpenAI body
        return _error(api.APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if server.engine is None:
            status = "failed: " + server.failed if server.failed else "loading"
            return JSONResponse({"status": status}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            _authorize(server, request)
        except api.APIError as exc:
            return _error(exc)
        return JSONResponse({"object": "list", "data": [{"id": server.served, "object": "model",
                                                         "created": 0, "owned_by": "lockstep"}]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        try:
            _authorize(server, request)
            if model_id != server.served:
                raise api.APIError(f"the model {model_id!r} does not exist; this server serves {server.served!r}",
                                   status=404, param="model")
        except api.APIError as exc:
            return _error(exc)
        return JSONResponse({"id": server.served, "object": "model", "created": 0, "owned_by": "lockstep"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(server, request, chat=True)

    return app


def _authorize(server: Server, request: Request) -> None:
    if server.api_key is None:
        return
    if request.headers.get("authorization", "") != f"Bearer {server.api_key}":
        raise api.APIError("a valid API key is required (Authorization: Bearer <key>)", status=401,
                           kind="authentication_error")


def _engine_request(server: Server, engine: Engine, parsed: api.Parsed, chat: bool, sink) -> EngineRequest:
    """Tokenize and validate into an engine request (APIError 400 on bad input)."""
    from core.generation.generate import encode_messages

    model = engine.model
    try:
        if chat:
            ids = encode_messages(model, [parsed.prompt])[0]
        elif isinstance(parsed.prompt, str):
            if model.tokenizer is None:
                raise RequestError("this model has no tokenizer; send the prompt as token ids")
            ids = model.tokenizer.encode(parsed.prompt)
        else:
            ids = parsed.prompt
        room = engine.capacity - len(ids) + 1  # the last token's KV is never written
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else (max(room, 1) if chat else 16)
        return engine.request(ids, max_tokens, parsed.sampling, parsed.stop, sink=sink,
                              logprobs=parsed.logprobs is not None)
    except (RequestError, ModelError) as exc:
        raise api.APIError(str(exc), param="messages" if chat else "prompt") from None


async def _complete(server: Server, request: Request, chat: bool) -> Response:
    engine = server.engine
    try:
        _authorize(server, request)
        if engine is None:
            raise api.APIError("the model is still loading", status=503, kind="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise api.APIError("the request body is not valid JSON") from None
        parsed = api.parse(body, api.CHAT_FIELDS if chat else api.COMPLETION_FIELDS, server.served, chat)
        sink = _Sink(server)
        req = sink.request = _engine_request(server, engine, parsed, chat, sink)
        try:
            engine.add(req)
        except QueueFullError as exc:
            server.metrics.rejected.labels("queue_full").inc()
            raise api.APIError(str(exc), status=429, kind="rate_limit_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosedError as exc:
            raise api.APIError(str(exc), status=503, kind="server_error") from None
    except api.APIError as exc:
        if exc.status == 400:
            server.metrics.rejected.labels("bad_request").inc()
        return _error(exc)
    rid = api.new_id(chat)
    if parsed.stream:
        return StreamingResponse(_stream(server, engine, req, sink.events, rid, chat, parsed),
                                 media_type="text/event-stream")
    return await _whole(server, engine, request, req, sink.events, rid, chat, parsed.logprobs)


def _logprobs(engine: Engine, chat: bool, top: int | None, entries: list, offset: int = 0) -> dict | None:
    """The OpenAI ``logprobs`` object of ``entries`` (None when the request did not ask)."""
    if top is None:
        return None
    tok = engine.model.tokenizer

    def text(t: int) -> str:
        return tok.decode([t]) if tok is not None else str(t)
    return api.logprobs_body(chat, top, entries, [text(e.token) for e in entries], [text(e.top_token) for e in entries],
                             offset)


class _Sink:
    """A request's sink, called on the engine's thread: the metrics see every event (an aborted
    request's too, after its client left), then the event goes to the request's coroutine."""

    def __init__(self, server: Server) -> None:
        self.server, self.loop = server, asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.request: EngineRequest | None = None
        self._last: float | None = None

    def __call__(self, event: Event) -> None:
        if self.request is not None:
            self._last = self.server.metrics.observe(self.request, event, self._last)
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


async def _whole(server: Server, engine: Engine, request: Request, req: EngineRequest, events: asyncio.Queue,
                 rid: str, chat: bool, top: int | None) -> Response:
    entries: list = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), 0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.abort(req.id)
                    return Response(status_code=499)
                continue
            entries += event.logprobs or []
            if event.finish_reason is not None:
                break
    except asyncio.CancelledError:
        engine.abort(req.id)
        raise
    if event.finish_reason == "error":
        return _error(api.APIError(event.error or "the request failed", status=500, kind="server_error"))
    return JSONResponse(api.response(rid, server.served, chat, req.text, event.finish_reason, req.usage,
                                     _logprobs(engine, chat, top, entries)))


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _stream(server: Server, engine: Engine, req: EngineRequest, events: asyncio.Queue, rid: str,
                  chat: bool, parsed: api.Parsed) -> AsyncIterator[str]:
    first = True
    done = False
    entries: list = []  # logprobs of the tokens not yet sent (their text may still be held back)
    offset = 0
    try:
        if chat:  # the role first, as OpenAI does
            yield _sse(api.chunk(rid, server.served, chat, "", None, first=True))
            first = False
        while not done:
            event = await events.get()
            done = event.finish_reason is not None
            entries += event.logprobs or []
            if event.text or done:
                lp = _logprobs(engine, chat, parsed.logprobs, entries, offset)
                if lp is not None and not chat:
                    offset += sum(len(t) for t in lp["tokens"])
                entries = []
                yield _sse(api.chunk(rid, server.served, chat, event.text if event.text or not chat else None,
                                     event.finish_reason, first=first, logprobs=lp))
                first = False
        if parsed.include_usage:
            yield _sse(api.chunk(rid, server.served, chat, None, None, usage=req.usage))
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away (the generator was closed or cancelled): free the slot
            engine.abort(req.id)
