"""The local endpoint: RunPod's URL layout on loopback, every route through the production handler.

    /openai/v1/{models, models/<id>, chat/completions, completions, embeddings, responses, responses/compact,
                responses/<id>[/input_items], messages, messages/count_tokens}
                                                                          (also under /v2/<endpoint_id>/)
    /v2/<endpoint_id>/{run, runsync, stream/<job_id>, status/<job_id>, cancel/<job_id>, health}
    /run, /runsync, /stream/<job_id>, ... and /health                     (the RunPod SDK's local paths)
    /tokenize, /detokenize, /metrics                        (vLLM's own; also under the /openai/v1 prefixes)

OpenAI routes wrap the request body into the job RunPod's platform would send
(`{"openai_route": ..., "openai_input": ...}`) and stream the handler's SSE text back as it comes; /health and
/metrics read the worker's state directly. When RUNPOD_API_KEY is set, every route except /health (and /metrics
with METRICS_PUBLIC=1) needs `Authorization: Bearer <key>` (or `x-api-key`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.anthropic.errors import COUNT_TOKENS, MESSAGES
from worker.http_guards import ApiKeyGuard, BodyLimit, error_response
from worker.job_store import Handler, JobStore, is_error, route_name
from worker.jobs import ADAPTER_ROUTES, EVENT_STREAMS
from worker.lora_routes import LOAD, UNLOAD
from worker.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from worker.openai.errors import (
    BadRequest,
    MethodNotAllowed,
    RouteNotFound,
    WorkerError,
    status_of,
)
from worker.openai.streaming import SSE_DONE, sse, sse_event
from worker.settings import Settings

OPENAI_PREFIXES = ("/openai/v1", "/v2/{endpoint_id}/openai/v1")
JOB_PREFIXES = ("", "/v2/{endpoint_id}")
# How often a request waiting for its answer checks that its HTTP client is still connected.
DISCONNECT_POLL_S = 0.5
# What a request answers once its client has gone (nobody reads it; nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499
# The Retry-After (seconds) of a refusal that a later try may not meet: the worker busy (429), starting or shutting
# down (503).
RETRY_AFTER_S = {429: 1, 503: 5}


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("We could not parse the JSON body of your request. The body must be valid JSON.") from None


def create_app(
    handler: Handler,
    settings: Settings,
    *,
    openai_prefixes: tuple[str, ...] = OPENAI_PREFIXES,
    refuse_when_full: bool = False,
) -> FastAPI:
    """The FastAPI app; `handler` is the production async generator handler. A load-balancing worker
    (worker/load_balancer.py) adds the bare /v1 prefix and refuses a generation request past its concurrency at once
    (`refuse_when_full`) instead of queueing it."""
    app = FastAPI(title="RunPod LLM worker (local)", docs_url=None, redoc_url=None, openapi_url=None)
    from worker.runtime import current

    gauge = current().concurrency
    store = JobStore(handler, gauge.limit)
    # Generation routes take a slot, as RunPod's jobs do; reads do not.
    generate = store.at_once if refuse_when_full else store.limited
    openai_call = functools.partial(_openai_call, store=store)
    app.state.jobs = store

    if settings.api_key:
        open_routes = ("/health", "/metrics") if settings.metrics_public else ("/health",)
        app.add_middleware(ApiKeyGuard, key=settings.api_key, open_routes=open_routes)
    app.add_middleware(BodyLimit, max_bytes=int(settings.max_request_mb * 2**20))  # outermost: before the key check

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(exc, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Paths outside the routes above, and wrong methods: OpenAI's error object, not FastAPI's {"detail"}.
        path = request.url.path
        if exc.status_code == 405:
            return error_response(
                MethodNotAllowed(f"Method {request.method} is not allowed on {path}"), exc.headers, path
            )
        return error_response(RouteNotFound(f"Unknown route {request.method} {path}", param=None), path=path)

    utility = APIRouter()  # vLLM's own routes, at the root as vLLM serves them and under the OpenAI prefixes

    @utility.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await openai_call(handler, "/tokenize", await _json_body(request), None)

    @utility.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await openai_call(handler, "/detokenize", await _json_body(request), None)

    @utility.get("/metrics")
    async def metrics() -> Response:
        from worker.jobs import metrics_text
        from worker.runtime import current

        try:
            return Response(metrics_text(current()), media_type=METRICS_CONTENT_TYPE)
        except WorkerError as exc:
            return error_response(exc)

    openai = APIRouter()

    @openai.get("/models")
    async def models() -> Response:
        return await openai_call(handler, "/v1/models", {}, None)

    @openai.get("/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await openai_call(handler, f"/v1/models/{model_id}", {}, None)

    @openai.post("/chat/completions")
    async def chat(request: Request) -> Response:
        return await openai_call(generate, "/v1/chat/completions", await _json_body(request), request)

    @openai.post("/completions")
    async def completions(request: Request) -> Response:
        return await openai_call(generate, "/v1/completions", await _json_body(request), request)

    @openai.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        return await openai_call(generate, "/v1/embeddings", await _json_body(request), request)

    @openai.post("/score")
    async def score(request: Request) -> Response:
        return await openai_call(generate, "/v1/score", await _json_body(request), request)

    @openai.post("/rerank")
    async def rerank(request: Request) -> Response:
        return await openai_call(generate, "/v1/rerank", await _json_body(request), request)

    @openai.post("/responses")
    async def responses(request: Request) -> Response:
        return await openai_call(generate, "/v1/responses", await _json_body(request), request)

    @openai.post("/responses/compact")
    async def compact(request: Request) -> Response:
        return await openai_call(generate, "/v1/responses/compact", await _json_body(request), request)

    @openai.get("/responses/{response_id}")
    async def response(response_id: str, request: Request) -> Response:
        return await openai_call(handler, f"/v1/responses/{response_id}", dict(request.query_params), None)

    @openai.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return await openai_call(handler, f"/v1/responses/{response_id}", {}, None, method="DELETE")

    @openai.get("/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request) -> Response:
        return await openai_call(handler, f"/v1/responses/{response_id}/input_items", dict(request.query_params), None)

    @openai.post("/messages")
    async def messages(request: Request) -> Response:
        return await openai_call(generate, MESSAGES, await _json_body(request), request)

    @openai.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await openai_call(handler, COUNT_TOKENS, await _json_body(request), None)

    @openai.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await openai_call(handler, LOAD, await _json_body(request), None)

    @openai.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await openai_call(handler, UNLOAD, await _json_body(request), None)

    @openai.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(rest: str, request: Request) -> Response:
        return error_response(RouteNotFound(f"Unknown route /v1/{rest}", param=None), path=request.url.path)

    openai_v2 = APIRouter()  # vLLM serves Cohere's rerank under /v2 too

    @openai_v2.post("/rerank")
    async def rerank_v2(request: Request) -> Response:
        return await openai_call(generate, "/v2/rerank", await _json_body(request), request)

    jobs = APIRouter()

    @jobs.post("/run")
    async def run(request: Request) -> Response:
        job = store.submit(await _job_input(request))
        return JSONResponse({"id": job.id, "status": job.status})

    @jobs.post("/runsync")
    async def runsync(request: Request) -> Response:
        job = store.submit(await _job_input(request))
        return JSONResponse(await store.wait(job))

    @jobs.api_route("/stream/{job_id}", methods=["GET", "POST"])
    async def stream(job_id: str) -> Response:
        job = store.get(job_id)
        return JSONResponse(await store.stream(job)) if job else _job_not_found(job_id)

    @jobs.api_route("/status/{job_id}", methods=["GET", "POST"])
    async def status(job_id: str) -> Response:
        job = store.get(job_id)
        return JSONResponse(job.result()) if job else _job_not_found(job_id)

    @jobs.post("/cancel/{job_id}")
    async def cancel(job_id: str) -> Response:
        job = store.get(job_id)
        return JSONResponse(await store.cancel(job)) if job else _job_not_found(job_id)

    @jobs.get("/health")
    async def health() -> Response:
        from worker.runtime import current, engine_stats

        jobs = store.health()
        running = int(jobs["inProgress"] > 0)
        return JSONResponse(
            {
                "jobs": jobs,
                "workers": {"idle": 1 - running, "running": running},
                "jobsByRoute": store.by_route(),
                "engine": engine_stats(current()),
            }
        )

    app.include_router(utility)
    for prefix in openai_prefixes:
        app.include_router(utility, prefix=prefix)  # before `openai`, whose last route takes every other path
        app.include_router(openai, prefix=prefix)
        app.include_router(openai_v2, prefix=prefix.removesuffix("/v1") + "/v2")
    for prefix in JOB_PREFIXES:
        app.include_router(jobs, prefix=prefix)
    return app


async def _job_input(request: Request) -> Any:
    body = await _json_body(request)
    if not isinstance(body, dict) or "input" not in body:
        raise BadRequest('the body must be a JSON object with an "input" field', param="input")
    return body["input"]


def _job_not_found(job_id: str) -> JSONResponse:
    return error_response(RouteNotFound(f"no job {job_id!r} on this worker", param="job_id"))


async def _openai_call(
    handler: Handler, route: str, body: Any, request: Request | None, method: str | None = None, *, store: JobStore
) -> Response:
    """Run an OpenAI request as the job RunPod would send, answering JSON or an SSE stream, counted in `store`'s
    counts as a job of its route is (/health).

    `method` goes into the job as `openai_method` where the route alone does not say what to do (DELETE)."""
    header_id = request.headers.get("x-request-id") if request is not None else None
    if header_id and isinstance(body, dict) and not body.get("request_id"):
        body = {**body, "request_id": header_id}
    request_id = header_id or (body.get("request_id") if isinstance(body, dict) else None)
    headers = {"X-Request-Id": str(request_id)} if request_id else None
    job_input = {"openai_route": route, "openai_input": body}
    if method is not None:
        job_input["openai_method"] = method
    job = {"id": f"openai-{uuid.uuid4().hex}", "input": job_input}
    end = store.begin(route_name(job_input))
    outputs = handler(job)
    try:
        first = await _first_output(outputs, request)
    except StopAsyncIteration:
        end("failed")
        return error_response(RuntimeError("the handler produced no output"))
    except ClientGone:
        end("cancelled")
        await outputs.aclose()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException:
        end("cancelled")
        await outputs.aclose()
        raise
    if isinstance(first, str) and route in ADAPTER_ROUTES:  # vLLM answers these with a line of text
        end("completed")
        await outputs.aclose()
        return PlainTextResponse(first, headers=headers)
    if is_error(first) or not (isinstance(body, dict) and body.get("stream") is True):
        end("failed" if is_error(first) else "completed")
        await outputs.aclose()
        status = status_of(first) or 200
        if status in RETRY_AFTER_S:  # busy or shutting down: when to try again (this worker, or RunPod's next one)
            headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S[status])}
        return JSONResponse(first, status_code=status, headers=headers)
    events = route in EVENT_STREAMS  # the Responses and Messages APIs stream named events
    return StreamingResponse(_sse(first, outputs, events, end), media_type="text/event-stream", headers=headers)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _first_output(outputs: AsyncGenerator[Any, None], request: Request | None) -> Any:
    """The handler's first output (the whole answer when not streamed).

    NOTE: a non-streamed answer is only written at the end, so nothing else notices a client that leaves
    meanwhile: poll for it, and cancel the job (which aborts its engine request and frees its pages).
    """
    if request is None:
        return await outputs.__anext__()
    pending = asyncio.ensure_future(outputs.__anext__())
    try:
        while not (await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                raise ClientGone
        return pending.result()
    finally:
        if not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


async def _sse(
    first: Any, outputs: AsyncGenerator[Any, None], events: bool, end: Callable[[str], None]
) -> AsyncGenerator[str, None]:
    """The handler's yields as SSE text: raw text as is; lists of chunk objects (RAW_OPENAI_OUTPUT=0) encoded,
    as named events for the Responses and Messages APIs (`events`), which end without [DONE]. `end` counts the
    request as completed once all went out, as cancelled when its client left first."""
    raw = isinstance(first, str)
    encode = sse_event if events else sse
    status = "cancelled"
    try:
        yield first if raw else "".join(encode(chunk) for chunk in first)
        async for output in outputs:
            yield output if isinstance(output, str) else "".join(encode(chunk) for chunk in output)
        if not raw and not events:
            yield SSE_DONE
        status = "completed"
    finally:
        end(status)
        await outputs.aclose()


def serve(handler: Handler, settings: Settings, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve the local endpoint until interrupted."""
    import uvicorn

    # NOTE: uvicorn cancels what still runs after its own timeout; the worker's grace period (worker/shutdown.py)
    # ends such requests with an error first, so its timeout only has to come later.
    uvicorn.run(
        create_app(handler, settings),
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=settings.shutdown_grace_s + 3,  # type: ignore[arg-type]  # typed int, takes float
    )
