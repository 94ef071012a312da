"""The `response` object of /v1/responses: state, output and usage, with the request's settings echoed.

Its shape meets both OpenAI's API and the Open Responses specification (the multi-vendor schema of the same
API): every key Open Responses requires is present (`presence_penalty`, `frequency_penalty`, function tools'
`description` / `parameters` / `strict`, a json_schema format's `description` and `strict`), and `usage` is an
object from the first stream event on. `safety_identifier` and `prompt_cache_key` are null when not sent, as
OpenAI's API returns them and Open Responses requires; `user`, which Open Responses does not define, is left
out when not sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.openai.generation import Collected
from worker.openai.params import DEFAULT_TEMPERATURE
from worker.openai.responses.request import ResponsesRequest

if TYPE_CHECKING:
    from worker.openai.chat import ChatCall
    from worker.openai.runtime import Runtime


@dataclass(kw_only=True)
class ResponseCall:
    """A validated Responses request, ready to run."""

    runtime: Runtime
    request: ResponsesRequest
    chat: ChatCall
    id: str
    created_at: int
    model: str
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the stored conversation this one continues (empty without previous_response_id)

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


def response_object(
    call: ResponseCall,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any],
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` object: its state and output, with the request's settings echoed as OpenAI does."""
    request = call.request
    incomplete = status == "incomplete"
    response = {
        "id": call.id,
        "object": "response",
        "created_at": call.created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "model": call.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
        "service_tier": "default",
        "store": request.store is not False,
        "temperature": DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "text": {"format": _text_format(request), "verbosity": (request.text and request.text.verbosity) or "medium"},
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": [_function_tool(tool) for tool in request.tools or []],
        "top_logprobs": request.top_logprobs or 0,
        "truncation": request.truncation or "disabled",
        "usage": usage,
        "metadata": request.metadata or {},
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
    }
    if request.user is not None:
        response["user"] = request.user
    if request.return_token_ids:  # vLLM's extension, as on chat: the prompt as the engine got it
        response["prompt_token_ids"] = list(call.chat.prompt.token_ids)
    return response


def _text_format(request: ResponsesRequest) -> dict[str, Any]:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt is not None else "text"}
    return {
        "type": "json_schema",
        "name": fmt.name,
        "schema": fmt.json_schema,
        "description": fmt.description,
        "strict": bool(fmt.strict),
    }


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as echoed: null where the request left a field out (`strict` null: not asked for; the
    arguments are held to `parameters` all the same)."""
    return {
        **tool,
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def opening_usage(prompt_tokens: int) -> dict[str, Any]:
    """Usage as `response.created` and `response.in_progress` carry it: the prompt counted, nothing generated
    yet (the prefix cache is looked up when the request is scheduled, so no cached tokens are counted yet)."""
    return usage_object(prompt_tokens, 0, 0, 0)


def final_usage(result: Collected, reasoning: int) -> dict[str, Any]:
    return usage_object(result.num_prompt_tokens, result.num_cached_tokens, result.num_generated_tokens, reasoning)


def usage_object(prompt: int, cached: int, generated: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + generated,
    }
