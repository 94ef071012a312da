"""Gemma 4's image preprocessing (transformers' Gemma4ImageProcessor, as its PIL backend computes it): the image
resized bicubically by Pillow, aspect ratio kept, to the largest size whose sides are multiples of
pooling_kernel_size * patch_size and whose patches fit max_soft_tokens * pooling_kernel_size^2; x / 255 (no
mean / std: the tower maps [0, 1] to [-1, 1] itself); then patch_size^2 patches row by row, each its pixels row by
row with the channels innermost. The tower pools each pooling_kernel_size^2 block of patches to one soft token, so an
image takes (rows / k) * (columns / k) of them: at most max_soft_tokens, fewer for most aspect ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import InvalidRequest
from engine.image.pixels import resize_and_normalise

if TYPE_CHECKING:
    import PIL.Image

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the budgets transformers' processor accepts


@dataclass(frozen=True, kw_only=True)
class Gemma4ImageConfig:
    """The processor settings preprocessor_config.json holds (transformers' defaults where it is silent)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)
    do_normalize: bool = False

    @classmethod
    def from_dict(cls, raw: dict) -> Gemma4ImageConfig:
        names = ("patch_size", "max_soft_tokens", "pooling_kernel_size", "rescale_factor", "resample", "do_normalize")
        fields = {k: raw[k] for k in names if raw.get(k) is not None}
        fields.update({k: tuple(raw[k]) for k in ("image_mean", "image_std") if raw.get(k) is not None})
        config = cls(**fields)
        if config.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, got {config.max_soft_tokens}")
        return config

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2


@dataclass(frozen=True)
class Gemma4Image:
    pixel_values: np.ndarray  # [rows * columns, patch_size^2 * 3] float32
    grid: tuple[int, int]  # (rows, columns) in patches

    def num_tokens(self, kernel: int) -> int:
        return self.grid[0] * self.grid[1] // kernel**2


def target_size(height: int, width: int, config: Gemma4ImageConfig) -> tuple[int, int]:
    """(height, width) the image is resized to (transformers' get_aspect_ratio_preserving_size)."""
    target_px = config.max_patches * config.patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = config.pooling_kernel_size * config.patch_size
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    longest = (config.max_patches // config.pooling_kernel_size**2) * side
    if h == 0 and w == 0:
        raise InvalidRequest(f"an image of {width}x{height} pixels is too small to cut into patches", param="image")
    if h == 0:  # a strip far wider than tall: one row of pooled patches
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > target_px:
        raise InvalidRequest(
            f"an image of {width}x{height} pixels would take more than {config.max_patches} patches", param="image"
        )
    return h, w


def preprocess(image: PIL.Image.Image, config: Gemma4ImageConfig) -> Gemma4Image:
    """An RGB Pillow image (engine.image.decode) -> its patches and grid."""
    height, width = target_size(image.height, image.width, config)
    mean, std = (config.image_mean, config.image_std) if config.do_normalize else ((0.0,) * 3, (1.0,) * 3)
    pixels = resize_and_normalise(image, width, height, config.resample, config.rescale_factor, mean, std)
    p = config.patch_size
    rows, cols = height // p, width // p
    patches = pixels.reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, p * p * 3)
    return Gemma4Image(np.ascontiguousarray(patches), (rows, cols))
