"""POST /v1/score and /v1/rerank (also /v2/rerank): a cross-encoder's relevance scores, in vLLM's shapes.

Each (text_1, text_2) or (query, document) pair is one prompt, tokenized as a pair (the tokenizer's pair template,
as transformers' `tokenizer(text, text_pair)` and vLLM do, with its token_type_ids) and run as one engine score
request: a decoder's score head on the last token, an encoder's on its first (engine/model/classifier.py).
`/v1/score` takes vLLM's `text_1` / `text_2` (or its `queries` with `documents` or `items`, or `data_1` / `data_2`):
one text against one, one against many, or many against as many; `/v1/rerank` takes Jina's and Cohere's `query`,
`documents`, `top_n` and `return_documents`, and answers the documents from the most relevant down.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from engine.outputs import PoolingOutput
from worker.openai.errors import BadRequest
from worker.openai.generation import engine_request_id, response_id
from worker.openai.models import resolve_model
from worker.openai.runtime import Runtime

EMBEDDINGS = "/v1/embeddings"
SCORE = "/v1/score"
RERANK = "/v1/rerank"
RERANK_V2 = "/v2/rerank"
MAX_INPUTS = 2048  # the most pairs one request scores (as embeddings' inputs)
# vLLM's names for the two sides of /v1/score, in the order it reads them.
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class _ScoringRequest(BaseModel):
    """What both routes take from vLLM: truncation, the activation switch, special tokens, a request id."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_activation: StrictBool | None = None  # vLLM's: false gives the head's raw logit
    add_special_tokens: StrictBool = True
    request_id: str | None = None
    stream: StrictBool | None = None


class RerankRequest(_ScoringRequest):
    query: str
    documents: list[Any]
    top_n: int = 0  # vLLM's default: every document
    return_documents: StrictBool = True


@dataclass(kw_only=True)
class ScoreCall:
    """A validated score or rerank request: its pairs tokenized, ready to run."""

    runtime: Runtime
    request: _ScoringRequest
    prompts: list[list[int]]
    token_type_ids: list[list[int]]  # each prompt's tokens' text of the pair (BERT reads them)
    documents: list[str]  # the second text of each pair (rerank answers them back)
    id: str
    model: str
    stream: bool = False  # scores never stream


def prepare_score(body: Any, runtime: Runtime) -> ScoreCall:
    """Parse a /v1/score request: one text against one, one against many, or many against as many."""
    request = _ScoringRequest.model_validate(_object(body))
    extra = request.model_extra or {}
    names = next((pair for pair in SCORE_SIDES if pair[0] in extra or pair[1] in extra), SCORE_SIDES[0])
    first, second = (_texts(extra.get(name), name) for name in names)
    if len(first) != 1 and len(first) != len(second):
        raise BadRequest(
            f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one {names[0]} for "
            f"all of {names[1]}, or as many as {names[1]} has",
            param=names[0],
        )
    return _call(runtime, request, first * len(second) if len(first) == 1 else first, second, "score")


def prepare_rerank(body: Any, runtime: Runtime) -> ScoreCall:
    """Parse a /v1/rerank (or /v2/rerank) request."""
    request = RerankRequest.model_validate(_object(body))
    if not request.query:
        raise BadRequest("query must not be empty", param="query")
    documents = [_document(d, i) for i, d in enumerate(request.documents)]
    if not documents:
        raise BadRequest("documents must hold at least one document", param="documents")
    if len(documents) > MAX_INPUTS:
        raise BadRequest(f"documents has {len(documents)} items; at most {MAX_INPUTS} per request", param="documents")
    if request.top_n < 0:
        raise BadRequest(f"top_n must be 0 (every document) or more, got {request.top_n}", param="top_n")
    return _call(runtime, request, [request.query] * len(documents), documents, "rerank")


def _call(runtime: Runtime, request: _ScoringRequest, first: list[str], second: list[str], kind: str) -> ScoreCall:
    if request.stream:
        raise BadRequest(f"{kind} requests are answered whole: leave stream unset or false", param="stream")
    model, adapter = resolve_model(runtime, request.model)
    if adapter is not None:
        raise BadRequest(
            f"scores come from the base model `{runtime.served_model_name}`, not the LoRA adapter `{adapter}`",
            param="model",
        )
    check_cross_encoder(runtime, f"/v1/{kind}")
    encode = runtime.tokenizer.encode_pair
    pairs = [encode(a, b, add_special_tokens=request.add_special_tokens) for a, b in zip(first, second, strict=True)]
    return ScoreCall(
        runtime=runtime,
        request=request,
        prompts=[ids for ids, _ in pairs],
        token_type_ids=[types for _, types in pairs],
        documents=second,
        id=response_id(kind, request.request_id),
        model=model,
    )


def check_cross_encoder(runtime: Runtime, route: str) -> None:
    """A 400 unless the served model is a single-label cross-encoder."""
    classifier = runtime.engine.classifier
    if classifier is None:
        kind = "an encoder (embeddings only)" if getattr(runtime.engine, "encoder", False) else "a generative model"
        raise BadRequest(
            f"{route} needs a cross-encoder (a *ForSequenceClassification checkpoint or "
            f"Qwen3-Reranker); `{runtime.served_model_name}` is {kind}",
            param="model",
        )
    if classifier.num_labels != 1:
        raise BadRequest(
            f"{route} needs a cross-encoder with one label; `{runtime.served_model_name}` has {classifier.num_labels}",
            param="model",
        )


def refuse_generation(runtime: Runtime, route: str) -> None:
    """A 400 for a generation or embedding route on a cross-encoder, which only scores, and for any but
    /v1/embeddings on an encoder (BERT-like), which only embeds."""
    if runtime.engine.classifier is not None:
        raise BadRequest(
            f"`{runtime.served_model_name}` is a cross-encoder: it serves {SCORE}, {RERANK} and "
            f"{RERANK_V2}, not {route}",
            param="model",
        )
    if getattr(runtime.engine, "encoder", False) and route != EMBEDDINGS:
        raise BadRequest(
            f"`{runtime.served_model_name}` is an encoder model: it only embeds ({EMBEDDINGS}), not {route}",
            param="model",
        )


async def create_score(call: ScoreCall) -> dict[str, Any]:
    """vLLM's score response: one `score` object per pair, in request order."""
    outputs = await _run(call)
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return {
        "id": call.id,
        "object": "list",
        "created": int(time.time()),
        "model": call.model,
        "data": [{"index": i, "object": "score", "score": o.embedding[0]} for i, o in enumerate(outputs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


async def create_rerank(call: ScoreCall) -> dict[str, Any]:
    """vLLM's (Jina's) rerank response: the documents by relevance, most relevant first, the top_n of them."""
    outputs = await _run(call)
    request: RerankRequest = call.request  # type: ignore[assignment]
    results = []
    for i, output in enumerate(outputs):
        result: dict[str, Any] = {"index": i, "relevance_score": output.embedding[0]}
        if request.return_documents:
            result["document"] = {"text": call.documents[i]}
        results.append(result)
    results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: equal scores keep request order
    if 0 < request.top_n < len(results):
        results = results[: request.top_n]
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return {
        "id": call.id,
        "model": call.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


async def _run(call: ScoreCall) -> list[PoolingOutput]:
    request, engine = call.request, call.runtime.engine
    truncate = call.runtime.max_model_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
    activation = request.use_activation is not False
    base = engine_request_id(call.id)
    tasks = [
        asyncio.ensure_future(
            engine.score(
                prompt,
                f"{base}-{i}",
                truncate_prompt_tokens=truncate or None,
                activation=activation,
                token_type_ids=types,
            )
        )
        for i, (prompt, types) in enumerate(zip(call.prompts, call.token_type_ids, strict=True))
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one pair failed or the caller went away: stop the others too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{name} must be a non-empty string or a non-empty list of strings", param=name)
    if len(value) > MAX_INPUTS:
        raise BadRequest(f"{name} has {len(value)} texts; at most {MAX_INPUTS} per request", param=name)
    if not all(isinstance(v, str) and v for v in value):
        raise BadRequest(f"{name}'s items must all be non-empty strings", param=name)
    return value


def _document(value: Any, index: int) -> str:
    """A document as a string, or Cohere's and Jina's `{"text": ...}` object."""
    text = value.get("text") if isinstance(value, dict) else value
    if not isinstance(text, str) or not text:
        raise BadRequest(
            f"documents.{index}: a document is a non-empty string or an object with a non-empty `text`",
            param=f"documents.{index}",
        )
    return text
