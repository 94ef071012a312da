"""Pixtral's image preprocessing for Mistral 3 (transformers' PixtralImageProcessor as its PIL backend computes it,
with the patch size Mistral3's PixtralProcessor passes it: the tower's patch_size * spatial_merge_size): an image
larger than size.longest_edge shrunk to fit it (aspect kept, floored), each side then rounded up to a multiple of
that patch, resized bicubically by Pillow; rescaled and normalised. The image takes one soft token per merged
patch, its rows each followed by one break token (the last by the end token)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import InvalidRequest
from engine.image.pixels import resize_and_normalise

if TYPE_CHECKING:
    import PIL.Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, kw_only=True)
class PixtralImageConfig:
    """The processor settings preprocessor_config.json holds (transformers' defaults where it is silent) and the
    merged patch (the tower's patch_size * spatial_merge_size) whose multiples the sides are rounded to."""

    merged_patch: int
    longest_edge: int = 1024
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_normalize: bool = True

    @classmethod
    def from_dict(cls, raw: dict, merged_patch: int) -> PixtralImageConfig:
        fields = {k: raw[k] for k in ("rescale_factor", "resample", "do_normalize") if raw.get(k) is not None}
        fields.update({k: tuple(raw[k]) for k in ("image_mean", "image_std") if raw.get(k) is not None})
        size = raw.get("size") or {}
        if size.get("longest_edge") is not None:
            fields["longest_edge"] = int(size["longest_edge"])
        return cls(merged_patch=merged_patch, **fields)


@dataclass(frozen=True)
class PixtralImage:
    pixel_values: np.ndarray  # [3, height, width] float32
    grid: tuple[int, int]  # (rows, columns) of merged patches: the image's soft tokens

    @property
    def num_tokens(self) -> int:
        """Its soft tokens plus one break (or end) token per row."""
        return self.grid[0] * (self.grid[1] + 1)


def target_size(height: int, width: int, config: PixtralImageConfig) -> tuple[int, int]:
    """(height, width) the image is resized to (transformers' pixtral get_resize_output_image_size)."""
    ratio = max(height / config.longest_edge, width / config.longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    if height == 0 or width == 0:  # (transformers' processor fails on it too)
        raise InvalidRequest(
            f"an image this thin cannot fit {config.longest_edge} pixels on its longest side", param="image"
        )
    p = config.merged_patch
    return ((height - 1) // p + 1) * p, ((width - 1) // p + 1) * p


def preprocess(image: PIL.Image.Image, config: PixtralImageConfig) -> PixtralImage:
    """An RGB Pillow image (engine.image.decode) -> its pixels and grid of merged patches."""
    height, width = target_size(image.height, image.width, config)
    mean, std = (config.image_mean, config.image_std) if config.do_normalize else ((0.0,) * 3, (1.0,) * 3)
    pixels = resize_and_normalise(image, width, height, config.resample, config.rescale_factor, mean, std)
    p = config.merged_patch
    return PixtralImage(np.ascontiguousarray(pixels), (height // p, width // p))
