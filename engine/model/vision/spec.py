"""What the engine knows of a model that takes images: its placeholder tokens, how many soft tokens an image
becomes, what its tower sees, and how an image's tokens attend and are positioned."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PatchGrid:
    """Qwen-VL's towers: an image of any size, cut into patch_size^2 patches (each temporal_patch_size frames
    deep), merge_size x merge_size patches to a soft token; its tokens take 3-D (t, h, w) rotary positions."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int


@dataclass(frozen=True)
class PooledPatches:
    """Gemma 4's tower: an image of any size within a patch budget, cut into patch_size^2 patches, each
    kernel x kernel block of them pooled to a soft token; its tokens take 1-D positions."""

    patch_size: int
    kernel: int


@dataclass(frozen=True, kw_only=True)
class BrokenRows:
    """Pixtral's tower (Mistral 3): an image of any size, cut into patch_size^2 patches, merge_size x merge_size of
    them merged to a soft token; in the prompt each row of soft tokens is followed by break_token_id, the last row
    by end_token_id instead, and those keep their own embeddings. Its tokens take 1-D positions."""

    patch_size: int
    merge_size: int
    break_token_id: int
    end_token_id: int


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """An image is a run of image_token_id tokens in the prompt (between boi and eoi): `tokens_per_image` of them
    for a tower that sees a fixed `image_size` square (Gemma 3), or as many as the image's merged patches (`grid`)
    or pooled patches (`pooled`), or rows of merged patches with a break token after each (`rows`)."""

    image_token_id: int
    tokens_per_image: int | None
    image_size: int | None
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    bidirectional: bool = False  # Gemma 3: an image's tokens see each other (transformers' token_type_ids mask)
    grid: PatchGrid | None = None
    pooled: PooledPatches | None = None
    rows: BrokenRows | None = None
    # Gemma 4: the image's tokens see each other both ways on the sliding-window layers only (its global layers
    # stay causal, transformers' create_masks_for_vision_model).
    bidirectional_windowed_only: bool = False

    def bidirectional_in(self, window: int | None) -> bool:
        """Whether an image's tokens see each other both ways in a KV group with this sliding window (None: full)."""
        return self.bidirectional and (window is not None or not self.bidirectional_windowed_only)
