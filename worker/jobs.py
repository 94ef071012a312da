"""A RunPod job -> its outputs: OpenAI pass-through (`openai_route` + `openai_input`) or a native job.

Everything that can reject a request (parsing, model name, parameters, the prompt's length) runs
before the first output, so a bad job yields exactly one OpenAI error object and nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from typing import Any

from engine.errors import EngineError
from worker.anthropic.errors import COUNT_TOKENS, MESSAGES, anthropic_error
from worker.anthropic.messages import complete_message, count_message_tokens, prepare_message, stream_message
from worker.lora_routes import LOAD, UNLOAD, load_lora_adapter, unload_lora_adapter
from worker.native import run_native
from worker.openai.chat import complete_chat, prepare_chat, stream_chat
from worker.openai.completions import complete, prepare_completion, stream_completion
from worker.openai.embeddings import create_embeddings, prepare_embeddings
from worker.openai.errors import BadRequest, RouteNotFound, error_body
from worker.openai.models import list_models, retrieve_model
from worker.openai.responses.compact import complete_compaction, prepare_compaction
from worker.openai.responses.resources import stored_response
from worker.openai.responses.route import complete_response, prepare_response, stream_response
from worker.openai.scoring import (
    RERANK,
    RERANK_V2,
    SCORE,
    create_rerank,
    create_score,
    prepare_rerank,
    prepare_score,
    refuse_generation,
)
from worker.openai.streaming import BatchSize, openai_stream
from worker.openai.tokenize import DETOKENIZE_ROUTES, TOKENIZE_ROUTES, detokenize, prepare_tokenize, tokenize
from worker.runtime import Runtime
from worker.unicode_check import check_unicode

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
COMPACT = "/v1/responses/compact"
MODELS = "/v1/models"
EMBEDDINGS = "/v1/embeddings"
# What the engine's error params are called on each route, where the route names them differently.
CLIENT_PARAM_NAMES = {
    CHAT: {"prompt": "messages"},
    RESPONSES: {"prompt": "input", "max_tokens": "max_output_tokens"},
    MESSAGES: {"prompt": "messages"},
    EMBEDDINGS: {"prompt": "input"},
    SCORE: {"prompt": "text_2"},
    RERANK: {"prompt": "documents"},
    RERANK_V2: {"prompt": "documents"},
}
# Routes that score with a cross-encoder: how each prepares a request (on a thread) and answers it.
SCORING: dict[str, tuple[Callable[[Any, Runtime], Any], Callable[[Any], Awaitable[Any]]]] = {
    SCORE: (prepare_score, create_score),
    RERANK: (prepare_rerank, create_rerank),
    RERANK_V2: (prepare_rerank, create_rerank),
    "/score": (prepare_score, create_score),  # vLLM serves these without the version too
    "/rerank": (prepare_rerank, create_rerank),
}
# vLLM's Prometheus text (its server's /metrics), as a job's one output.
METRICS_ROUTES = ("/metrics", "/v1/metrics")
# Routes that stream named events (an SSE `event:` line per event, no [DONE] at the end).
EVENT_STREAMS = (RESPONSES, MESSAGES)
# vLLM's routes that load and unload LoRA adapters while serving (each answers one line of text).
ADAPTER_ROUTES = {LOAD: load_lora_adapter, UNLOAD: unload_lora_adapter}
# Routes that generate: how each prepares a request (on a thread), answers it whole, and streams it.
GENERATIONS: dict[
    str,
    tuple[Callable[[Any, Runtime], Any], Callable[[Any], Awaitable[Any]], Callable[[Any], AsyncGenerator[Any, None]]],
] = {
    CHAT: (prepare_chat, complete_chat, stream_chat),
    COMPLETIONS: (prepare_completion, complete, stream_completion),
    RESPONSES: (prepare_response, complete_response, stream_response),
    MESSAGES: (prepare_message, complete_message, stream_message),
}


async def run_job(job: Any, runtime: Runtime) -> AsyncGenerator[Any, None]:
    """Yield the outputs of one job (`{"id": ..., "input": {...}}`); failures become error objects."""
    source: AsyncGenerator[Any, None] | None = None
    describe: Callable[[BaseException], dict[str, Any]] = error_body
    try:
        job_input = job.get("input") if isinstance(job, dict) else None
        if not isinstance(job_input, dict):
            raise BadRequest("the job's input must be a JSON object", param="input")
        openai = "openai_route" in job_input
        describe = _error_shape(job_input.get("openai_route")) if openai else error_body
        body = job_input.get("openai_input") if openai else None
        if isinstance(body, dict):  # an OpenAI request's fields are named as the client wrote them
            check_unicode(body)
        check_unicode({k: v for k, v in job_input.items() if not (isinstance(body, dict) and k == "openai_input")})
        if not openai:
            refuse_generation(runtime, "native generation jobs")
        source = _openai(job_input, runtime) if openai else run_native(job_input, runtime)
        first = await source.__anext__()
    except StopAsyncIteration:
        return
    except Exception as exc:
        if source is not None:
            await source.aclose()
        yield describe(exc)
        return
    try:
        yield first
        async for output in source:
            yield output
    except Exception as exc:  # a native stream that fails midway: its partial output already went out
        yield describe(exc)
    finally:
        await source.aclose()


def _error_shape(route: Any) -> Callable[[BaseException], dict[str, Any]]:
    """How a route's errors are written: Anthropic's shape on the Messages API, OpenAI's everywhere else."""
    try:
        return anthropic_error if normalize_route(route) in (MESSAGES, COUNT_TOKENS) else error_body
    except BadRequest:
        return error_body


def close_when_cancelled(outputs: AsyncGenerator[Any, None]) -> None:
    """Close `outputs` (aborting its engine requests, freeing their pages) once the task consuming it is cancelled.

    NOTE: RunPod's SDK stops a job by cancelling its task, often while that task awaits the upload of an output:
    the job's generators then sit suspended at a yield, where no CancelledError reaches them, and only the
    garbage collector would close them, with the request still decoding meanwhile.
    """
    task = asyncio.current_task()
    if task is None:
        return

    def on_done(done: asyncio.Task) -> None:
        if done.cancelled():
            asyncio.get_running_loop().create_task(outputs.aclose())

    task.add_done_callback(on_done)


def normalize_route(route: Any) -> str:
    """`/v1/chat/completions`, also when written `v1/chat/completions/` or `/openai/v1/chat/completions`."""
    if not isinstance(route, str):
        raise BadRequest("openai_route must be a string such as /v1/chat/completions", param="openai_route")
    path = "/" + route.strip().strip("/")
    return path.removeprefix("/openai")


async def _openai(job_input: dict[str, Any], runtime: Runtime) -> AsyncGenerator[Any, None]:
    route = normalize_route(job_input.get("openai_route"))
    body = job_input.get("openai_input")
    body = {} if body is None else body
    if route in GENERATIONS or route in (COMPACT, EMBEDDINGS, COUNT_TOKENS):
        refuse_generation(runtime, route)
    if route == MODELS:
        yield list_models(runtime)
    elif route.startswith(MODELS + "/"):
        yield retrieve_model(runtime, route[len(MODELS) + 1 :])
    elif route in ADAPTER_ROUTES:
        yield await ADAPTER_ROUTES[route](body, runtime)
    elif route == COUNT_TOKENS:
        yield await count_message_tokens(body, runtime)
    elif route in TOKENIZE_ROUTES:
        yield await tokenize(await asyncio.to_thread(prepare_tokenize, body, runtime))  # renders off the loop
    elif route in DETOKENIZE_ROUTES:
        yield await asyncio.to_thread(detokenize, body, runtime)
    elif route in METRICS_ROUTES:
        yield metrics_text(runtime)
    elif route == COMPACT:
        compaction = await asyncio.to_thread(prepare_compaction, body, runtime)
        with _client_names(RESPONSES):
            yield await complete_compaction(compaction)
    elif route in SCORING:
        prepare, run = SCORING[route]
        call = await asyncio.to_thread(prepare, body, runtime)
        with _client_names(route):
            yield await run(call)
    elif route == EMBEDDINGS:
        embedding = await asyncio.to_thread(prepare_embeddings, body, runtime)
        with _client_names(EMBEDDINGS):
            yield await create_embeddings(embedding)
    elif route.startswith(RESPONSES + "/"):
        method = str(job_input.get("openai_method") or "GET").upper()
        yield stored_response(runtime.responses, route[len(RESPONSES) + 1 :], method, body)
    elif route in GENERATIONS:
        prepare, complete, stream = GENERATIONS[route]
        # NOTE: off the event loop: rendering and tokenizing a long prompt would stall every other stream.
        call = await asyncio.to_thread(prepare, body, runtime)
        if not call.stream:
            with _client_names(route):
                answer = await complete(call)
            yield answer
            return
        chunks = stream(call)
        with _client_names(route):
            first = await chunks.__anext__()  # the engine request has started: the request was accepted
        settings = runtime.settings
        sizes = BatchSize(
            settings.default_batch_size, settings.default_min_batch_size, settings.default_batch_size_growth_factor
        )
        events = route in EVENT_STREAMS
        error = anthropic_error if route == MESSAGES else error_body
        async with aclosing(
            openai_stream(_prepend(first, chunks), settings.raw_openai_output, sizes, events=events, error=error)
        ) as groups:
            async for group in groups:
                yield group
    else:
        raise RouteNotFound(
            f"Unknown openai_route {route!r}: this worker serves {CHAT}, {COMPLETIONS}, "
            f"{RESPONSES}, {COMPACT}, {MESSAGES}, {COUNT_TOKENS}, {EMBEDDINGS}, {SCORE}, {RERANK}, "
            f"{RERANK_V2}, {MODELS}, /tokenize, /detokenize and /metrics",
            param="openai_route",
        )


def metrics_text(runtime: Runtime) -> str:
    """Every metric in Prometheus' text format."""
    if runtime.metrics is None:
        raise RouteNotFound("this worker collects no metrics", param="openai_route")
    return runtime.metrics.exposition()


@contextmanager
def _client_names(route: str) -> Iterator[None]:
    """The engine names a request's parts as a completion's (`prompt`, `max_tokens`); say them as the route does."""
    try:
        yield
    except EngineError as exc:
        exc.param = CLIENT_PARAM_NAMES.get(route, {}).get(exc.param or "", exc.param)
        raise


async def _prepend(first: Any, rest: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
