"""The request model of POST /v1/responses: OpenAI's fields plus the sampling extras chat takes.

Fields this worker cannot honour but clients send on every call (`service_tier`, `prompt_cache_key`,
`safety_identifier`, `prompt_cache_retention`) are accepted and ignored; ones whose meaning it cannot
give (`background`, `conversation`, stored `prompt` templates, several choices) are a 400 naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from worker.openai.errors import BadRequest
from worker.openai.protocol import MAX_LOGPROBS, SamplingFields

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What `include` may name (OpenAI's enum); only the logprobs one changes what this worker returns.
INCLUDABLE = frozenset(
    {
        LOGPROBS_INCLUDE,
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
# Fields that are not chat parameters: the Responses layer reads them itself.
RESPONSES_ONLY = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "top_logprobs",
        "include",
        "text",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning",
        "metadata",
        "store",
        "previous_response_id",
        "truncation",
        "background",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "prompt_cache_retention",
        "max_tool_calls",
        "conversation",
        "prompt",
        "stream",
        "stream_options",
    }
)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(SamplingFields):
    """POST /v1/responses."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = True
    previous_response_id: str | None = Field(None, min_length=1)
    truncation: Literal["auto", "disabled"] | None = None
    background: StrictBool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    # Accepted and ignored: routing and caching hints of OpenAI's platform.
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="after")
    def _check_responses(self) -> ResponsesRequest:
        refused = {
            "background": "background responses are not supported; leave background unset or false",
            "conversation": "conversations are not supported; use previous_response_id to continue a response",
            "prompt": "stored prompt templates are not supported; send the input itself",
        }
        for name, message in refused.items():
            if getattr(self, name, None) or (self.model_extra or {}).get(name):
                raise BadRequest(message, param=name)
        if self.n != 1 or self.best_of not in (None, 1) or self.use_beam_search:
            param = "n" if self.n != 1 else "best_of" if self.best_of not in (None, 1) else "use_beam_search"
            raise BadRequest(
                "a response has one output; n, best_of and beam search are for chat completions", param=param
            )
        if self.echo:
            raise BadRequest("echo is not supported on /v1/responses", param="echo")
        if self.response_format is not None:
            raise BadRequest(
                "the Responses API sets the output format with text.format, not response_format",
                param="response_format",
            )
        for index, name in enumerate(self.include or []):
            if name not in INCLUDABLE:
                raise BadRequest(
                    f"include[{index}] {name!r} is not one of {sorted(INCLUDABLE)}", param=f"include[{index}]"
                )
        if self.metadata is not None:
            _check_metadata(self.metadata)
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


def _check_metadata(metadata: dict[str, str]) -> None:
    """OpenAI's limits: up to 16 pairs, keys up to 64 characters, values up to 512."""
    if len(metadata) > 16:
        raise BadRequest("metadata may hold at most 16 key-value pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise BadRequest(
                f"metadata key {key[:64]!r}: keys are at most 64 characters and values at most 512", param="metadata"
            )
