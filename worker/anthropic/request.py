"""The request models of POST /v1/messages and /v1/messages/count_tokens: Anthropic's fields, checked.

Fields that steer Anthropic's platform and mean nothing here (`service_tier`, `inference_geo`, `speed`,
`diagnostics`, `metadata`, `user_profile_id`, `workspace_id`) are accepted and ignored; `cache_control` is checked
and read by worker/anthropic/caching.py (it steers what `usage` reports); ones
whose meaning this worker cannot give (`container`, `mcp_servers`, `context_management`) are a 400 naming them.
The sampling extras that chat completions take from vLLM (`temperature` aside, which Anthropic's newest client
no longer sends: `chat_template`, `seed`, `min_p`, structured outputs, ...) pass through to the chat request;
any other unknown field is a 400, as Anthropic's API answers it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from worker.openai.errors import BadRequest

# vLLM's extras that chat completions takes and a Messages request may send too (`extra_body`).
CHAT_EXTRAS = frozenset(
    {
        "chat_template",
        "chat_template_kwargs",
        "seed",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "skip_special_tokens",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "request_id",
        "truncate_prompt_tokens",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "regex",
        "ebnf",
        "json_schema",
        "priority",
    }
)
IGNORED = frozenset(
    {
        "service_tier",
        "inference_geo",
        "speed",
        "cache_control",
        "diagnostics",
        "metadata",
        "user_profile_id",
        "workspace_id",
    }
)
REFUSED = {
    "container": "containers (code execution) are not supported by this worker",
    "mcp_servers": "MCP servers are not supported by this worker; define their tools as custom tools",
    "context_management": "context management is not supported by this worker",
}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled", "adaptive"]
    # NOTE: accepted, not enforced: the reasoning runs until the model closes it or max_tokens ends the answer.
    budget_tokens: int | None = Field(None, ge=1)
    display: str | None = None


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: JsonFormat | None = None  # the structured-outputs beta's spelling of output_config.format

    @model_validator(mode="after")
    def _check_fields(self) -> CountTokensRequest:
        for name, message in REFUSED.items():
            if (self.model_extra or {}).get(name):
                raise BadRequest(f"{name}: {message}", param=name)
        for name in self.model_extra or {}:
            if name not in CHAT_EXTRAS and name not in IGNORED and name not in REFUSED and name not in _FIELDS:
                raise BadRequest(f"{name}: Extra inputs are not permitted", param=name)
        if self.output_config is not None and self.output_config.format is not None and self.output_format:
            raise BadRequest(
                "output_format: set the output format once, in output_config.format", param="output_format"
            )
        return self

    @property
    def extras(self) -> dict[str, Any]:
        """The chat extras the request sent."""
        return {k: v for k, v in (self.model_extra or {}).items() if k in CHAT_EXTRAS}

    @property
    def output_schema(self) -> tuple[dict[str, Any], str] | None:
        """The JSON schema the text must follow, and the field that set it."""
        if self.output_config is not None and self.output_config.format is not None:
            return self.output_config.format.json_schema, "output_config.format"
        if self.output_format is not None:
            return self.output_format.json_schema, "output_format"
        return None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: StrictBool = False


# Fields a count_tokens request may carry because a Messages request does (clients count what they will send).
_FIELDS = frozenset(MessagesRequest.model_fields)
