"""What the engine knows of a model that takes images: its placeholder tokens, how many soft tokens an image
becomes, the square its tower sees, and whether an image's tokens attend to each other both ways."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionSpec:
    """An image is a run of `tokens_per_image` image_token_id tokens in the prompt (between boi and eoi)."""

    image_token_id: int
    tokens_per_image: int
    image_size: int
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    bidirectional: bool = False  # Gemma 3: an image's tokens see each other (transformers' token_type_ids mask)
