"""POST /tokenize and /detokenize in vLLM's shapes: a prompt (or chat messages, rendered exactly as a chat completion
renders them, images widened as the engine widens them) to token ids and their count, and token ids back to text.
Nothing runs on the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from worker.openai.chat import ChatCall, chat_call
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


@dataclass(kw_only=True)
class TokenizeCall:
    """A validated /tokenize request: its prompt's token ids, and the chat whose images the engine widens."""

    runtime: Runtime
    tokens: list[int]
    chat: ChatCall | None = None  # the chat form, when its messages hold images
    with_strings: bool = False


def prepare_tokenize(body: Any, runtime: Runtime) -> TokenizeCall:
    """A prompt or chat messages to token ids (the chat rendered as a chat completion renders it)."""
    body = _object(body)
    if "messages" in body and "prompt" in body:
        raise BadRequest("give either prompt or messages, not both", param="messages")
    if "messages" in body:
        chat = TokenizeChatRequest.model_validate(body)
        fields = chat.model_dump(include=set(CHAT_FIELDS), exclude_none=True)
        request = ChatCompletionRequest.model_validate({**fields, "model": chat.model or runtime.served_model_name})
        call = chat_call(request, runtime)
        return TokenizeCall(
            runtime=runtime,
            tokens=call.prompt.token_ids,
            chat=call if call.prompt.images else None,
            with_strings=bool(chat.return_token_strs),
        )
    prompt = TokenizeCompletionRequest.model_validate(body)
    _check_model(prompt.model, runtime)
    tokens = runtime.tokenizer.encode(prompt.prompt, add_special_tokens=prompt.add_special_tokens)
    return TokenizeCall(runtime=runtime, tokens=tokens, with_strings=bool(prompt.return_token_strs))


async def tokenize(call: TokenizeCall) -> dict[str, Any]:
    """`{"count", "max_model_len", "tokens", "token_strs"}`; each image counts the tokens the engine widens its
    placeholder to, as a chat completion's prompt does."""
    runtime, tokens = call.runtime, call.tokens
    if call.chat is not None:
        tokens = await runtime.engine.widened_prompt(tokens, await call.chat.image_files())
    strings = runtime.tokenizer.convert_ids_to_tokens(tokens) if call.with_strings else None
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


def _check_model(model: str | None, runtime: Runtime) -> None:
    if model is not None:
        resolve_model(runtime, model)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body
