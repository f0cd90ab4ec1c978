"""`moepager serve`'s HTTP API: OpenAI's completions, chat completions and models, plus health, Prometheus
metrics, JSON statistics and the web page.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: malformed JSON and invalid fields
are 400 with the reason, an unknown model 404; nothing a request sends can stop the server.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moepager.errors import InvalidRequestError, MoepagerError, Unavailable
from moepager.runtime.llm import LLM
from moepager.runtime.request import Request as EngineRequest
from moepager.runtime.request import RequestOutput
from moepager.runtime.sampling import SamplingParams, TokenLogprobs
from moepager.server.async_engine import AsyncEngine, Delivery
from moepager.server.metrics import CONTENT_TYPE, Metrics
from moepager.server.protocol import UNSUPPORTED_ERROR, ChatCompletionRequest, CompletionRequest

BODY_BYTES_PER_POSITION = 64
"""A request body may take this many bytes per position of the model's context (JSON-escaped text, \\uXXXX for
every character at worst, and a chat's framing), beyond BODY_BYTES_BASE: a longer body cannot hold a prompt the
context takes, and is refused before it is read."""
BODY_BYTES_BASE = 1 << 20
DISCONNECT_CHECK_S = 0.5
"""How often a request that is not streamed checks that its client is still there."""
CHAT_MAX_TOKENS = 1024
"""A chat request without max_tokens generates at most this many (or up to the context, if shorter)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def install_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape: invalid bodies 400, our own errors 400 (a bad request), 503 (the engine
    can no longer run: a lost worker process) or 500."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        kind = first.get("type")
        if kind == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('msg', '')}")
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if kind == UNSUPPORTED_ERROR:
            field = first.get("ctx", {}).get("field")
            return error_response(400, first.get("msg", "unsupported field"), "unsupported_field", field)
        if kind == "extra_forbidden":
            return error_response(400, f"unknown field '{where}'", "unknown_field", where)
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(MoepagerError)
    async def refused(request: Request, exc: MoepagerError) -> JSONResponse:
        status = 400 if isinstance(exc, InvalidRequestError) else 503 if isinstance(exc, Unavailable) else 500
        return error_response(status, str(exc))


class BodyLimit:
    """ASGI middleware: a request whose body is longer than `limit` bytes is answered 413 (OpenAI's error shape)
    before its body is read, by its Content-Length, or as soon as a chunked body passes the limit."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(send)
            return
        seen, started, refused = 0, False, False

        async def counted() -> dict[str, Any]:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if not started and not refused:
                        refused = True
                        await self._refuse(send)  # answered here: the app may turn the error below into its own
                    raise _TooLarge
            return message

        async def watched(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out already
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            pass

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"error": {"message": f"the request body exceeds {self.limit} bytes (longer than any prompt "
                                                f"this model's context holds)", "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def create_app(llm: LLM, model_name: str, engine_thread: bool = True) -> FastAPI:
    """The app; its engine steps on a thread of its own, or (`engine_thread=False`) on whichever thread calls
    `app.state.engine.run()` (`moepager serve`: the main thread, with uvicorn on another)."""
    llm.check_runs_prompts()
    metrics = Metrics(llm.engine, llm.store, model_name)
    engine = AsyncEngine(llm.engine, metrics)
    context = llm.loaded.config.max_position_embeddings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine_thread:
            engine.start()
        else:
            engine.attach()
        yield
        engine.stop()

    app = FastAPI(title="moepager", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(BodyLimit, limit=BODY_BYTES_BASE + BODY_BYTES_PER_POSITION * context)

    install_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"model '{name}' not found; this server serves '{model_name}'", "model_not_found",
                           "model")

    @app.get("/health")
    async def health() -> Any:
        if engine.unavailable is not None:  # 503: for a supervisor or load balancer to take it out and restart it
            return JSONResponse({"status": "unavailable", "reason": engine.unavailable}, status_code=503)
        return {"status": "ok"}

    card = {"id": model_name, "object": "model", "created": int(metrics.started_s), "owned_by": "moepager",
            "max_model_len": context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return card

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.prometheus(), media_type=CONTENT_TYPE)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return metrics.snapshot()

    web_page = files("moepager.server").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return web_page

    def check_length(chars: int) -> None:
        """Refuse a text that cannot fit the context before tokenising it (n characters are at least
        n / max_token_chars tokens)."""
        tokenizer = llm.tokenizer
        if tokenizer is not None and chars > context * tokenizer.max_token_chars:
            raise ApiError(400, f"the prompt's {chars} characters are more tokens than fit: it exceeds the model's "
                                f"context of {context} tokens", "context_length_exceeded", "prompt")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Any:
        check_model(body.model)
        prompt = body.prompt_value()
        if isinstance(prompt, str):
            check_length(len(prompt))
        ids = await asyncio.to_thread(llm.encode, prompt)  # off the event loop: other requests go on meanwhile
        params = body.params(body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
        shape = CompletionShape(llm, model_name, ids, params)
        return await respond(engine, http, ids, params, body.stream, body.include_usage, shape)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request) -> Any:
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_length(sum(len(m["content"]) for m in messages))
        ids = await asyncio.to_thread(llm.encode_chat, messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.params(limit if limit is not None else max(1, min(CHAT_MAX_TOKENS, context - len(ids))),
                             body.chat_logprobs())
        shape = ChatShape(llm, model_name, ids, params)
        return await respond(engine, http, ids, params, body.stream, body.include_usage, shape)

    return app


async def respond(engine: AsyncEngine, http: Request, ids: list[int], params: SamplingParams, stream: bool,
                  include_usage: bool, shape: Shape) -> Any:
    request, queue = engine.submit(ids, params)
    if stream:
        return StreamingResponse(stream_events(engine, request, queue, shape, include_usage),
                                 media_type="text/event-stream")
    try:
        checked = time.monotonic()
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                item = None
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:  # tokens may arrive faster than the check
                checked = time.monotonic()
                if await http.is_disconnected():
                    return None
            if isinstance(item, BaseException):
                raise ApiError(503 if isinstance(item, Unavailable) else 500, f"generation failed: {item}")
            if item is not None and item.finished:
                return shape.final(request)
    finally:
        engine.abort(request.request_id)


async def stream_events(engine: AsyncEngine, request: EngineRequest, queue: asyncio.Queue[Delivery], shape: Shape,
                        include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events, one per step that changed the request (then the usage, if asked); a client that goes
    away cancels this generator, and `finally` aborts the request."""
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):  # the error, then the end: the client stops reading at once
                failed = {"error": {"message": f"generation failed: {item}", "type": "server_error"}}
                yield f"data: {json.dumps(failed)}\n\n"
                yield "data: [DONE]\n\n"
                return
            if item.new_text or item.finished or item.new_logprobs:
                yield f"data: {json.dumps(shape.chunk(item))}\n\n"
            if item.finished:
                if include_usage:
                    usage = {**shape.envelope(shape.chunk_object), "choices": [], "usage": shape.usage(request)}
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
                return
    finally:
        engine.abort(request.request_id)


class Shape(ABC):
    """How one endpoint writes its chunks and final response."""

    chunk_object = "text_completion"

    def __init__(self, llm: LLM, model: str, ids: list[int], params: SamplingParams):
        self.llm, self.model, self.prompt_tokens, self.params = llm, model, len(ids), params
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.first = True

    prefix = "cmpl"

    def envelope(self, obj: str, choice: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice] if choice is not None else []}

    @abstractmethod
    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        """One streamed event's body."""

    @abstractmethod
    def final(self, request: EngineRequest) -> dict[str, Any]:
        """The whole response of a request that was not streamed."""

    def usage(self, request: EngineRequest) -> dict[str, int]:
        out = len(request.out_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": out, "total_tokens": self.prompt_tokens + out}

    def token_text(self, token: int) -> str:
        return self.llm.tokenizer.decode([token]) if self.llm.tokenizer is not None else str(token)


class CompletionShape(Shape):
    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        return self.envelope("text_completion", {"index": 0, "text": out.new_text, "finish_reason": out.finish_reason,
                                                 "logprobs": self.logprobs(out.new_logprobs)})

    def final(self, request: EngineRequest) -> dict[str, Any]:
        body = self.envelope("text_completion", {"index": 0, "text": request.text.text,
                                                 "finish_reason": request.finish_reason,
                                                 "logprobs": self.logprobs(request.logprobs)})
        return {**body, "usage": self.usage(request)}

    def logprobs(self, values: list[TokenLogprobs]) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None
        tokens = [self.token_text(v.token) for v in values]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [v[v.token] for v in values],
                "top_logprobs": [{self.token_text(t): lp for t, lp in top(v, self.params.logprobs)} for v in values]
                if self.params.logprobs else None,
                "text_offset": offsets}


class ChatShape(Shape):
    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if self.first else {}
        self.first = False
        if out.new_text:
            delta["content"] = out.new_text
        return self.envelope("chat.completion.chunk", {"index": 0, "delta": delta, "finish_reason": out.finish_reason,
                                                       "logprobs": self.logprobs(out.new_logprobs)})

    def final(self, request: EngineRequest) -> dict[str, Any]:
        body = self.envelope("chat.completion", {"index": 0, "finish_reason": request.finish_reason,
                                                 "message": {"role": "assistant", "content": request.text.text},
                                                 "logprobs": self.logprobs(request.logprobs)})
        return {**body, "usage": self.usage(request)}

    def logprobs(self, values: list[TokenLogprobs]) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(v.token, v[v.token]),
                             "top_logprobs": [entry(t, lp) for t, lp in top(v, self.params.logprobs)]}
                            for v in values]}


def top(values: TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of a sampled position (the sampled token among them only if it is)."""
    return sorted(values.items(), key=lambda item: -item[1])[:n]
