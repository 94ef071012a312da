"""Request models of the OpenAI routes: OpenAI's parameters plus vLLM's and SGLang's extras.

Unknown fields are accepted and ignored (clients such as LangChain send their own); known ones are
typed and range-checked here, so a bad value is a 400 that names the parameter as the client spelled
it (cross-field checks raise BadRequest, which pydantic lets through, to name theirs). Defaults follow
OpenAI: completions stop after 16 tokens, chat runs to the end of the context.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from worker.openai.errors import BadRequest
from worker.openai.tools.definitions import check_tool_choice, check_tools

MAX_LOGPROBS = 20
INT64 = 2**63

Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema (`strict` is accepted; the grammar is always strict)."""

    # By alias both ways, so that a dumped request (the Responses route re-validates one) reads back the same.
    model_config = ConfigDict(extra="allow", populate_by_name=True, serialize_by_alias=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: Any = Field(None, alias="schema")  # checked when the constraint is built, naming response_format
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (and the older `guided_decoding`): at most one of the constraint fields.

    Unknown keys are a 400 here: a misspelt constraint must not run unconstrained.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    json_: str | dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: StrictBool = False
    disable_fallback: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: str | None = None
    backend: str | None = None


class SamplingFields(BaseModel):
    """The sampling parameters chat and completions share (vLLM's names where OpenAI has none)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, Bias] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    early_stopping: StrictBool = False
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    bad_words: list[str] | None = None
    echo: StrictBool = False
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's: the request's place under SCHEDULING_POLICY=priority (lower runs first); ignored under fcfs
    priority: int = Field(0, ge=-INT64, lt=INT64)
    return_token_ids: StrictBool | None = False
    response_format: ResponseFormat | None = None
    # Structured outputs by vLLM's names (engine spec built in worker/openai/structured.py) and SGLang's.
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_best_of(self) -> SamplingFields:
        if self.best_of is not None and self.best_of < self.n:
            raise BadRequest(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        return self


class MessageFunction(BaseModel):
    """The function a call of the history named, and its arguments (JSON text as returned, or an object)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] | None = None


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history, as the chat API returned it."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunction


class ChatMessage(BaseModel):
    """One chat message; content may be a string or a list of content parts (text only here).

    An assistant turn may carry `tool_calls` (its content then may be null) and a `tool` turn the
    `tool_call_id` it answers; both reach the chat template (worker/openai/tools/prompt.py).
    """

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None  # checked by worker/openai/tools/definitions.py, naming tools[i]...
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    separate_reasoning: StrictBool = True  # SGLang's: false keeps the reasoning in the content as written

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("logprobs must be true when top_logprobs is set", param="top_logprobs")
        check_tool_choice(self.tool_choice, check_tools(self.tools))
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest(
                "continue_final_message and add_generation_prompt cannot both be true; "
                "set add_generation_prompt to false to continue the final message",
                param="continue_final_message",
            )
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[str] | list[int] | list[list[int]]
LEGACY_MAX_TOKENS = 16  # /v1/completions' default output limit, as OpenAI's legacy API


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: int | None = Field(LEGACY_MAX_TOKENS, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: StrictBool = True
    suffix: str | None = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any) -> Any:
        # NOTE: clients that serialise unset fields send null; on this route that must mean the legacy 16,
        # not chat's "up to the context", or a forgotten field runs to the end of the context.
        return LEGACY_MAX_TOKENS if value is None else value

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.prompt == [] or self.prompt == "" or any(p == [] for p in self.prompt if isinstance(p, list)):
            raise BadRequest("prompt must not be empty", param="prompt")
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest(
                "max_tokens must be at least 1; 0 is for echo=true, which returns the prompt "
                "(with its logprobs) without generating",
                param="max_tokens",
            )
        return self

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, nothing generated (lm-eval's loglikelihood)."""
        return self.echo and self.max_tokens == 0

    @property
    def output_limit(self) -> int | None:
        # NOTE: the engine always generates; scoring runs one token and the response leaves it out, as vLLM.
        return 1 if self.scores_only else self.max_tokens
