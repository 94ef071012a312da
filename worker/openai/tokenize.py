"""POST /tokenize and /detokenize in vLLM's shapes: a prompt (or chat messages, rendered exactly as a chat completion
renders them) to token ids and their count, and token ids back to text. Nothing runs on the engine."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from worker.openai.chat import chat_call
from worker.openai.errors import BadRequest
from worker.openai.models import resolve_model
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.runtime import Runtime

TOKENIZE_ROUTES = ("/tokenize", "/v1/tokenize")
DETOKENIZE_ROUTES = ("/detokenize", "/v1/detokenize")
# The chat form's fields that render the prompt, handed to the chat completion's own rendering.
CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class TokenizeCompletionRequest(BaseModel):
    """vLLM's completion form: one prompt string."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's chat form: the messages as a chat completion takes them (checked there)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]


def tokenize(body: Any, runtime: Runtime) -> dict[str, Any]:
    """`{"count", "max_model_len", "tokens", "token_strs"}` for a prompt or for chat messages."""
    body = _object(body)
    if "messages" in body and "prompt" in body:
        raise BadRequest("give either prompt or messages, not both", param="messages")
    if "messages" in body:
        chat = TokenizeChatRequest.model_validate(body)
        tokens, with_strings = _chat_tokens(chat, runtime), chat.return_token_strs
    else:
        request = TokenizeCompletionRequest.model_validate(body)
        _check_model(request.model, runtime)
        tokens = runtime.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        with_strings = request.return_token_strs
    strings = runtime.tokenizer.convert_ids_to_tokens(tokens) if with_strings else None
    return {"count": len(tokens), "max_model_len": runtime.max_model_len, "tokens": tokens, "token_strs": strings}


def detokenize(body: Any, runtime: Runtime) -> dict[str, Any]:
    """`{"prompt"}`: the token ids decoded as they are, special tokens included (as vLLM)."""
    request = DetokenizeRequest.model_validate(_object(body))
    _check_model(request.model, runtime)
    vocabulary = len(runtime.tokenizer)
    for index, token in enumerate(request.tokens):
        if not 0 <= token < vocabulary:
            raise BadRequest(
                f"token id {token} is outside this model's vocabulary (ids 0 to {vocabulary - 1})",
                param=f"tokens.[{index}]",
            )
    return {"prompt": runtime.tokenizer.decode(request.tokens)}


def _chat_tokens(request: TokenizeChatRequest, runtime: Runtime) -> list[int]:
    fields = request.model_dump(include=set(CHAT_FIELDS), exclude_none=True)
    chat = ChatCompletionRequest.model_validate({**fields, "model": request.model or runtime.served_model_name})
    call = chat_call(chat, runtime)
    if call.prompt.images:
        raise BadRequest(
            "/tokenize does not count images (their token count depends on the image); /v1/messages/count_tokens does",
            param="messages",
        )
    return call.prompt.token_ids


def _check_model(model: str | None, runtime: Runtime) -> None:
    if model is not None:
        resolve_model(runtime, model)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body
