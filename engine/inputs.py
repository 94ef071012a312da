"""Public input types beside a prompt's token ids: an image as the bytes of its file, and how a vision model's
prompt shows one (the placeholder its chat template writes and the text that placeholder becomes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageData:
    """One image of a request, as its file's bytes; `param` names where it came from, for errors."""

    data: bytes
    param: str = "image"


@dataclass(frozen=True)
class ImagePrompt:
    """The chat template writes `placeholder` once per image; the prompt holds `expansion` there instead (as
    transformers' processor expands it), whose `tokens_per_image` soft tokens take the image's embeddings. None:
    the count depends on the image's size (Qwen-VL), and the engine widens the expansion's one image token to it."""

    placeholder: str
    expansion: str
    tokens_per_image: int | None
