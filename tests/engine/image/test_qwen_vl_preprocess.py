"""Qwen-VL image preprocessing (engine/image/qwen_vl.py) held to transformers' own Qwen2VLImageProcessorPil, value
for value: random images of many sizes and aspect ratios (below the pixel floor, above the ceiling, thin strips,
odd sides), under Qwen2-VL's defaults, Qwen2.5-VL's preprocessor_config.json (top-level min_pixels / max_pixels) and
a Qwen3-VL / Qwen3.5-style config (16-pixel patches, mean 0.5), and an RGBA image through the same RGB conversion."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import InvalidRequest
from engine.image.decode import to_rgb
from engine.image.qwen_vl import QwenVLImageConfig, preprocess, smart_resize

PIL = pytest.importorskip("PIL.Image")
CONFIGS = {
    "qwen2_vl": {},
    "qwen2_5_vl": {  # Qwen2.5-VL-7B-Instruct's and olmOCR-2's preprocessor_config.json
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "qwen3_vl": {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    },
    "small_budget": {"min_pixels": 3136, "max_pixels": 200704},
}
SIZES = [
    (1, 1),
    (7, 300),
    (28, 28),
    (33, 57),
    (100, 100),
    (224, 640),
    (480, 640),
    (511, 1023),
    (1080, 1920),
    (2000, 150),
    (3000, 4000),
]


def reference(config: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**config)


def random_image(height: int, width: int, seed: int, mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode=mode)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_patches_and_grids_equal_transformers(name):
    ours, theirs = QwenVLImageConfig.from_dict(CONFIGS[name]), reference(CONFIGS[name])
    for i, (h, w) in enumerate(SIZES):
        if max(h, w) / min(h, w) > 200:
            continue
        image = random_image(h, w, seed=i)
        want = theirs(images=[image], return_tensors="np")
        got = preprocess(image, ours)
        assert got.grid_thw == tuple(want["image_grid_thw"][0]), (h, w)
        assert got.pixel_values.dtype == np.float32
        np.testing.assert_array_equal(got.pixel_values, want["pixel_values"], err_msg=f"{h}x{w}")
        assert got.num_tokens(ours.merge_size) * ours.merge_size**2 == got.pixel_values.shape[0]


def test_transparency_goes_onto_white_as_transformers_does():
    config = CONFIGS["qwen2_vl"]
    image = random_image(64, 96, seed=5, mode="RGBA")
    want = reference(config)(images=[image], return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(preprocess(to_rgb(image), QwenVLImageConfig.from_dict(config)).pixel_values, want)


def test_the_pixel_budget_and_an_extreme_aspect_ratio():
    config = QwenVLImageConfig.from_dict(CONFIGS["small_budget"])
    h, w = smart_resize(4000, 3000, config)
    assert h % config.factor == w % config.factor == 0 and h * w <= config.max_pixels
    h, w = smart_resize(10, 10, config)
    assert h * w >= config.min_pixels
    with pytest.raises(InvalidRequest, match="200 times"):
        smart_resize(10, 2010, config)
