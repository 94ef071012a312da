"""Gemma 4 image preprocessing (engine/image/gemma4.py) held to transformers' own Gemma4ImageProcessorPil, value for
value: random images of many sizes and aspect ratios (tiny, huge, thin strips either way, already the target size)
under the default budget and the smallest and largest ones, the soft-token count equal to the processor's, and an
RGBA image through the same RGB conversion."""

from __future__ import annotations

import numpy as np
import pytest

from engine.image.decode import to_rgb
from engine.image.gemma4 import Gemma4ImageConfig, preprocess

PIL = pytest.importorskip("PIL.Image")
CONFIGS = {
    "default": {},
    "small": {"max_soft_tokens": 70},
    "large": {"max_soft_tokens": 1120},
    "tiny_tower": {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70},
}
SIZES = [
    (1, 1),
    (5, 700),
    (700, 5),
    (48, 48),
    (33, 57),
    (100, 100),
    (224, 640),
    (480, 640),
    (672, 672),
    (1080, 1920),
    (2000, 150),
    (3000, 4000),
]


def reference(config: dict):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(**config)


def random_image(height: int, width: int, seed: int, mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode=mode)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_patches_and_token_counts_equal_transformers(name):
    ours, theirs = Gemma4ImageConfig.from_dict(CONFIGS[name]), reference(CONFIGS[name])
    for i, (h, w) in enumerate(SIZES):
        image = random_image(h, w, seed=i)
        want = theirs(images=[image], return_tensors="np")
        got = preprocess(image, ours)
        n = got.pixel_values.shape[0]
        assert got.pixel_values.dtype == np.float32
        np.testing.assert_array_equal(got.pixel_values, want["pixel_values"][0][:n], err_msg=f"{h}x{w}")
        assert (want["image_position_ids"][0][n:] == -1).all(), (h, w)  # the rest is the processor's padding
        rows, cols = got.grid
        positions = np.stack(np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy"), -1).reshape(n, 2)
        np.testing.assert_array_equal(want["image_position_ids"][0][:n], positions)
        assert got.num_tokens(ours.pooling_kernel_size) == want["num_soft_tokens_per_image"][0], (h, w)
        assert got.num_tokens(ours.pooling_kernel_size) <= ours.max_soft_tokens


def test_transparency_goes_onto_white_as_transformers_does():
    image = random_image(64, 96, seed=5, mode="RGBA")
    want = reference({})(images=[image], return_tensors="np")["pixel_values"][0]
    got = preprocess(to_rgb(image), Gemma4ImageConfig()).pixel_values
    np.testing.assert_array_equal(got, want[: got.shape[0]])


def test_an_unknown_budget_is_refused():
    with pytest.raises(ValueError, match="max_soft_tokens"):
        Gemma4ImageConfig.from_dict({"max_soft_tokens": 100})
