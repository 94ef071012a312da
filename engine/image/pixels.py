"""The steps every image processor of transformers' PIL backend shares, with its numbers: a Pillow resize of the
uint8 image, x * rescale_factor in float64 then float32, (x - mean) / std in float32, channels first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import PIL.Image


def resize_and_normalise(
    image: PIL.Image.Image,
    width: int,
    height: int,
    resample: int,
    rescale_factor: float,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> np.ndarray:
    """An RGB Pillow image -> [3, height, width] float32."""
    resized = np.asarray(image.resize((width, height), resample=resample))  # [H, W, 3] uint8
    pixels = (resized.astype(np.float64) * rescale_factor).astype(np.float32)
    return ((pixels - np.array(mean, dtype=np.float32)) / np.array(std, dtype=np.float32)).transpose(2, 0, 1)
