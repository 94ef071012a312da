"""POST /v1/embeddings: one engine embedding request per input, answered whole (embeddings do not stream).

`input` is a string, a list of strings, a list of token ids or a list of such lists; each becomes its own engine
request, pooled as the model says (engine/model/pooling.py). `encoding_format` "base64" sends each vector as its
float32 bytes, little-endian, base64-encoded, as OpenAI's API does.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from array import array
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from engine.outputs import PoolingOutput
from worker.openai.errors import BadRequest
from worker.openai.generation import engine_request_id, response_id
from worker.openai.models import resolve_model
from worker.openai.runtime import Runtime

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    """OpenAI's embedding parameters plus vLLM's `truncate_prompt_tokens`, `add_special_tokens` and `request_id`."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: StrictBool = True
    request_id: str | None = None
    stream: StrictBool | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any) -> str | list:
        if isinstance(value, str):
            if not value:
                raise BadRequest("input must not be an empty string", param="input")
            return value
        if not isinstance(value, list) or not value:
            raise BadRequest(
                "input must be a non-empty string, a list of strings, a list of token ids, or a list of such lists",
                param="input",
            )
        if _token_ids(value):
            return value
        if len(value) > MAX_INPUTS:
            raise BadRequest(f"input has {len(value)} items; at most {MAX_INPUTS} per request", param="input")
        if all(isinstance(v, str) and v for v in value) or all(isinstance(v, list) and _token_ids(v) for v in value):
            return value
        raise BadRequest(
            "input's items must all be non-empty strings or all non-empty lists of token ids (integers from 0)",
            param="input",
        )

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value:
            raise BadRequest("embeddings are answered whole: leave stream unset or false", param="stream")
        return value


@dataclass(kw_only=True)
class EmbeddingCall:
    """A validated embeddings request: its inputs tokenized, ready to run."""

    runtime: Runtime
    request: EmbeddingRequest
    prompts: list[list[int]]
    id: str
    model: str
    stream: bool = False  # embeddings never stream


def prepare_embeddings(body: Any, runtime: Runtime) -> EmbeddingCall:
    """Parse, check the model and tokenize every input."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request = EmbeddingRequest.model_validate(body)
    model, adapter = resolve_model(runtime, request.model)
    if adapter is not None:
        raise BadRequest(
            f"embeddings come from the base model `{runtime.served_model_name}`, not the LoRA adapter `{adapter}`",
            param="model",
        )
    given = request.input
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        given = [given]
    tokenizer = runtime.tokenizer
    prompts = [
        list(p) if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=request.add_special_tokens)
        for p in given
    ]
    return EmbeddingCall(
        runtime=runtime, request=request, prompts=prompts, id=response_id("embd", request.request_id), model=model
    )


async def create_embeddings(call: EmbeddingCall) -> dict[str, Any]:
    """The whole `list` of `embedding` objects, in input order, with usage."""
    request, engine = call.request, call.runtime.engine
    truncate = request.truncate_prompt_tokens
    if truncate == -1:  # vLLM's "the model's context length"
        truncate = call.runtime.max_model_len
    base = engine_request_id(call.id)
    tasks = [
        asyncio.ensure_future(
            engine.embed(p, f"{base}-{i}", dimensions=request.dimensions, truncate_prompt_tokens=truncate or None)
        )
        for i, p in enumerate(call.prompts)
    ]
    try:
        outputs: list[PoolingOutput] = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one input failed or the caller went away: stop the others too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return {
        "id": call.id,
        "object": "list",
        "created": int(time.time()),
        "model": call.model,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(o.embedding, request.encoding_format)}
            for i, o in enumerate(outputs)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _token_ids(value: list) -> bool:
    return bool(value) and all(type(t) is int and t >= 0 for t in value)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    packed = array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
