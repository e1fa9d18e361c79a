"""The HTTP side (Starlette): OpenAI's endpoints over the :class:`~dllm.serve.batcher.Batcher`.

``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /metrics``.
With an API key every path but ``/health`` needs ``Authorization: Bearer KEY``. ``stream: true`` answers with
server-sent events in OpenAI's chunk format: each choice's text as its tokens are committed (a masked diffusion
model never changes a committed token, so what is sent is final), then its ``finish_reason``, the usage when
``stream_options.include_usage`` asks for it, and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dllm.serve.batcher import Batcher
from dllm.serve.metrics import Metrics
from dllm.serve.protocol import ApiError, Job, Settings, bad, chunk, completion_body, usage_chunk

log = logging.getLogger("dllm.serve")


def error_response(error: ApiError, headers: dict | None = None) -> Response:
    if error.status == 503:
        headers = {**(headers or {}), "Retry-After": "1"}
    # ASCII JSON: a message may quote what the client sent, lone surrogates included
    return Response(json.dumps(error.body()), error.status, headers, media_type="application/json")


def build_app(
    settings: Settings,
    batcher: Batcher,
    metrics: Metrics,
    api_key: str | None = None,
    max_body_size: int = 4 * 2**20,
) -> Starlette:
    """The ASGI application. The batcher's thread starts and stops with it (Starlette's lifespan)."""

    def authorised(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110 section 11.1); the key is compared in constant time
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())

    def guarded(endpoint: str, handler):
        async def route(request: Request) -> Response:
            started = time.perf_counter()
            if not authorised(request):
                response = error_response(
                    ApiError(401, "a valid API key is required: send Authorization: Bearer KEY", code="invalid_api_key")
                )
            else:
                try:
                    response = await handler(request)
                except ApiError as error:
                    response = error_response(error)
                except Exception as error:  # noqa: BLE001 - answered, logged, and the server goes on
                    log.exception("%s failed", endpoint)
                    response = error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}"))
            if request.method == "POST":
                metrics.request(endpoint, response.status_code)
                if response.status_code == 200 and not isinstance(response, StreamingResponse):
                    metrics.latency_of(time.perf_counter() - started)
            return response

        return route

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": settings.name, "queue": batcher.depth})

    async def models(request: Request) -> Response:
        entry = {"id": settings.name, "object": "model", "created": 0, "owned_by": "dllm"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def show_metrics(request: Request) -> Response:
        text = metrics.render(batcher.depth, batcher.running)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def body_of(request: Request):
        too_large = ApiError(
            413,
            f"the request body is larger than this server's limit of {max_body_size} bytes (dllm serve "
            "--max-body-size)",
            code="request_too_large",
            kind="invalid_request_error",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_size:
            raise too_large
        body = bytearray()
        async for part in request.stream():  # a chunked body declares no length: count as it comes
            body += part
            if len(body) > max_body_size:
                raise too_large
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad(
                "the request body is nested too deeply to read (JSON objects and lists within each other)"
            ) from None

    def generation(kind: str):
        async def handler(request: Request) -> Response:
            started = time.perf_counter()
            job = settings.parse(await body_of(request), kind)
            batcher.check(job)
            job.bind(asyncio.get_running_loop())
            batcher.submit(job)
            if job.stream:
                return StreamingResponse(events(job, started), media_type="text/event-stream")
            return await answer(job, request)

        return handler

    async def answer(job: Job, request: Request) -> Response:
        waiting = asyncio.ensure_future(_outcome(job))
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if waiting not in done:  # the client went away: free its place
            batcher.cancel(job)
            waiting.cancel()
            return Response(status_code=499)
        gone.cancel()
        kind, payload = waiting.result()
        if kind == "error":
            raise payload
        return JSONResponse(completion_body(job, payload))

    async def events(job: Job, started: float):
        """The server-sent events of a streamed request; a client that disconnects cancels it (``finally``)."""
        finished = False
        sent = {i: "" for i in range(job.rows)}
        try:
            if job.kind == "chat":
                for i in range(job.rows):
                    yield _sse(chunk(job, i, role=True))
            while True:
                event = await job.events.get()
                if event[0] == "delta":
                    _, index, text = event
                    sent[index] += text
                    yield _sse(chunk(job, index, text))
                    continue
                if event[0] == "error":
                    yield _sse(event[1].body())
                    break
                answer = event[1]
                for i, choice in enumerate(answer.choices):
                    rest = choice.text[len(sent[i]) :] if choice.text.startswith(sent[i]) else ""
                    yield _sse(chunk(job, i, rest or None, choice.finish_reason))
                if job.include_usage:
                    yield _sse(usage_chunk(job, answer))
                metrics.latency_of(time.perf_counter() - started)
                break
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                batcher.cancel(job)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        batcher.stop(timeout=30)

    routes = [
        Route("/health", health),
        Route("/v1/models", guarded("/v1/models", models)),
        Route("/metrics", guarded("/metrics", show_metrics)),
        Route("/v1/completions", guarded("/v1/completions", generation("completion")), methods=["POST"]),
        Route("/v1/chat/completions", guarded("/v1/chat/completions", generation("chat")), methods=["POST"]),
    ]

    paths = "GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics"

    async def not_found(request: Request, exc) -> Response:
        message = f"{request.method} {request.url.path}: no such endpoint; {paths}"
        return error_response(ApiError(404, message, code="not_found"))

    async def not_allowed(request: Request, exc) -> Response:
        allowed = (getattr(exc, "headers", None) or {}).get("Allow", "")
        message = f"{request.method} {request.url.path}: method not allowed; use {allowed or 'another method'}"
        error = ApiError(405, message, code="method_not_allowed", kind="invalid_request_error")
        return error_response(error, {"Allow": allowed} if allowed else None)

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})


async def _outcome(job: Job) -> tuple:
    while True:
        event = await job.events.get()
        if event[0] != "delta":
            return event


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
