"""Gemma 3's image preprocessing (transformers' Gemma3ImageProcessor; its SigLIP tower sees a fixed square), as its
PIL backend computes it: optionally pan and scan first (an image much wider or taller than square also gives
2 or more crops side by side, each processed as an image of its own, after the whole), then each is resized
bilinearly by Pillow to size x size and normalised (engine/image/pixels.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.image.pixels import resize_and_normalise

if TYPE_CHECKING:
    import PIL.Image

STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True, kw_only=True)
class GemmaImageConfig:
    """The processor settings preprocessor_config.json holds (transformers' defaults where it is silent)."""

    height: int = 224
    width: int = 224
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    rescale_factor: float = 1 / 255
    resample: int = 2  # PIL's BILINEAR
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2

    @classmethod
    def from_dict(cls, raw: dict) -> GemmaImageConfig:
        size = raw.get("size") or {}
        fields = {
            k: raw[k]
            for k in (
                "rescale_factor",
                "resample",
                "do_pan_and_scan",
                "pan_and_scan_min_crop_size",
                "pan_and_scan_max_num_crops",
                "pan_and_scan_min_ratio_to_activate",
            )
            if raw.get(k) is not None
        }
        fields.update({k: tuple(raw[k]) for k in ("image_mean", "image_std") if raw.get(k) is not None})
        fields.update({k: int(size[k]) for k in ("height", "width") if size.get(k)})
        return cls(**fields)


def pan_and_scan_crops(height: int, width: int, config: GemmaImageConfig) -> list[tuple[int, int, int, int]]:
    """(top, left, crop height, crop width) of each crop pan and scan adds for an image of this size (none when it
    is near square or the crops would be smaller than the minimum), as transformers cuts them."""
    long, short, wide = (width, height, True) if width >= height else (height, width, False)
    if long / short < config.pan_and_scan_min_ratio_to_activate:
        return []
    crops = int(math.floor(long / short + 0.5))
    crops = min(int(math.floor(long / config.pan_and_scan_min_crop_size)), crops)
    crops = min(config.pan_and_scan_max_num_crops, max(2, crops))
    crops_w, crops_h = (crops, 1) if wide else (1, crops)
    size_w, size_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
    if min(size_w, size_h) < config.pan_and_scan_min_crop_size:
        return []
    return [(size_h * i, size_w * j, size_h, size_w) for i in range(crops_h) for j in range(crops_w)]


def preprocess(image: PIL.Image.Image, config: GemmaImageConfig) -> np.ndarray:
    """An RGB Pillow image (engine.image.decode) -> [1 + crops, 3, height, width] float32: the whole image, then
    its pan-and-scan crops when the config enables them."""
    from PIL import Image

    whole = np.asarray(image)
    parts = [image]
    if config.do_pan_and_scan:
        parts += [
            Image.fromarray(whole[top : top + h, left : left + w])
            for top, left, h, w in pan_and_scan_crops(image.height, image.width, config)
        ]
    return np.stack(
        [
            resize_and_normalise(
                part,
                config.width,
                config.height,
                config.resample,
                config.rescale_factor,
                config.image_mean,
                config.image_std,
            )
            for part in parts
        ]
    )
