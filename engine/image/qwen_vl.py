"""Qwen-VL's image preprocessing (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5: transformers' Qwen2VLImageProcessor), as
its PIL backend computes it: each side rounded to a multiple of patch_size * merge_size with the pixel count kept
between the config's bounds ("smart resize"), a bicubic resize by Pillow, x * rescale_factor in float64 then
float32, (x - mean) / std in float32, then patches of patch_size^2 pixels, each repeated temporal_patch_size times
(an image is a one-frame video), listed merge_size x merge_size block by block. The model merges each block of
merge_size^2 patches into one token: an image of grid (1, h, w) takes h * w / merge_size^2 placeholder tokens.
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

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200


@dataclass(frozen=True, kw_only=True)
class QwenVLImageConfig:
    """The processor settings preprocessor_config.json holds (transformers' defaults where it is silent)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC

    @classmethod
    def from_dict(cls, raw: dict) -> QwenVLImageConfig:
        """From preprocessor_config.json; its pixel bounds as `size` {shortest_edge, longest_edge} or the older
        top-level min_pixels / max_pixels."""
        size = raw.get("size") or {}
        fields = {
            k: raw[k]
            for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample")
            if raw.get(k) is not None
        }
        fields.update({k: tuple(raw[k]) for k in ("image_mean", "image_std") if raw.get(k) is not None})
        for field_name, keys in (
            ("min_pixels", ("shortest_edge", "min_pixels")),
            ("max_pixels", ("longest_edge", "max_pixels")),
        ):
            value = raw.get(field_name) or next((size[k] for k in keys if size.get(k)), None)
            if value:
                fields[field_name] = int(value)
        return cls(**fields)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class QwenVLImage:
    pixel_values: np.ndarray  # [h * w, 3 * temporal_patch_size * patch_size^2] float32
    grid_thw: tuple[int, int, int]  # (1, h, w) in patches

    def num_tokens(self, merge_size: int) -> int:
        """Placeholder tokens the image takes in the prompt."""
        return self.grid_thw[1] * self.grid_thw[2] // merge_size**2


def smart_resize(height: int, width: int, config: QwenVLImageConfig) -> tuple[int, int]:
    """(height, width) for an image of the given size: multiples of config.factor, the aspect ratio nearly kept,
    the pixel count within [min_pixels, max_pixels] (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InvalidRequest(
            f"an image of {width}x{height} pixels is more than {MAX_ASPECT} times as long as it is wide", param="image"
        )
    factor = config.factor
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(image: PIL.Image.Image, config: QwenVLImageConfig) -> QwenVLImage:
    """An RGB Pillow image (engine.image.decode) -> its patches and grid."""
    height, width = smart_resize(image.height, image.width, config)
    pixels = resize_and_normalise(
        image, width, height, config.resample, config.rescale_factor, config.image_mean, config.image_std
    )  # [3, H, W]
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = pixels.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return QwenVLImage(np.ascontiguousarray(patches).reshape(grid_h * grid_w, 3 * t * p * p), (1, grid_h, grid_w))
