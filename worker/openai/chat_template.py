"""Chat messages -> prompt token ids through the model's (or a custom) Jinja chat template."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.openai.errors import BadRequest


@dataclass
class ChatPrompt:
    """What the template produced: its text and token ids, plus the messages as the template saw them."""

    text: str
    token_ids: list[int]
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)  # worker.openai.images.ImageRef, in prompt order


def message_text(content: Any, index: int) -> str:
    """A message's content as one string: text parts joined; other part types are not supported."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise BadRequest(
                f"content part type {kind!r} is not supported by this model; only text is",
                param=f"messages.[{index}].content",
            )
    return "\n".join(texts)


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts with string content, the form every chat template handles; a message with images
    (worker/openai/images.py made them {"type": "image"} parts) keeps its parts, its text ones as {"type": "text"},
    the form a vision model's template renders."""
    out = []
    for index, message in enumerate(messages):
        item = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        content = item.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            item["content"] = [
                p if p.get("type") == "image" else {"type": "text", "text": message_text([p], index)} for p in content
            ]
        else:
            item["content"] = message_text(content, index)
        out.append(item)
    return out


def expand_images(text: str, images: int, image_prompt: Any) -> str:
    """The rendered prompt with each image's placeholder expanded as transformers' processor does; BadRequest when
    the template did not place every image."""
    if not images:
        return text
    placed = text.count(image_prompt.placeholder)
    if placed != images:
        raise BadRequest(
            f"the chat template placed {placed} images of the request's {images} (it renders "
            f"{image_prompt.placeholder} per image part)",
            param="messages",
        )
    return text.replace(image_prompt.placeholder, image_prompt.expansion)


_TAKES_SYSTEM: dict[str, bool] = {}  # template text -> whether it renders a system turn


def takes_system_turn(tokenizer: Any, template: str) -> bool:
    """Whether `template` renders a leading system turn (Gemma 2's raises instead), tried once per template. No
    template: True (render_chat says it is missing)."""
    if not template:
        return True
    if template not in _TAKES_SYSTEM:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        try:
            tokenizer.apply_chat_template(probe, tokenize=False, chat_template=template, add_generation_prompt=True)
            _TAKES_SYSTEM[template] = True
        except Exception:  # noqa: BLE001 - raise_exception() in the template, or anything it trips on
            _TAKES_SYSTEM[template] = False
    return _TAKES_SYSTEM[template]


def render_chat(
    tokenizer: Any,
    messages: list[Any],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    documents: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    images: int = 0,
    image_prompt: Any = None,
) -> ChatPrompt:
    """Render `messages` with the template (request's, else CUSTOM_CHAT_TEMPLATE, else the model's) and tokenize;
    `images` placeholders expand as `image_prompt` (engine.inputs.ImagePrompt) says."""
    plain = template_messages(messages)
    if continue_final_message and plain[-1]["role"] == "system":
        raise BadRequest("continue_final_message needs a final user or assistant message", param="messages")
    kwargs = dict(template_kwargs or {})
    # A user's kwargs must not override the arguments the API itself controls.
    for reserved in ("messages", "tokenize", "chat_template", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(reserved, None)
    if documents is not None:
        kwargs["documents"] = documents
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest(
            "this model has no chat template; pass chat_template or use /v1/completions", param="chat_template"
        )
    try:
        text = tokenizer.apply_chat_template(
            plain,
            tokenize=False,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except BadRequest:
        raise
    except Exception as exc:  # Jinja syntax errors, raise_exception() inside templates, bad kwargs
        raise BadRequest(f"the chat template failed: {exc}", param="chat_template") from None
    text = expand_images(text, images, image_prompt)
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ChatPrompt(text=text, token_ids=token_ids, messages=plain)
