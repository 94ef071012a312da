"""Gemma 3 image preprocessing (engine/image/gemma.py) held to transformers' own Gemma3ImageProcessorPil, value
for value, over many sizes and aspect ratios, with pan and scan off (the default) and on (wide and tall images
giving 2-4 crops, near-square and small ones none)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.image.gemma import GemmaImageConfig, pan_and_scan_crops, preprocess

PIL = pytest.importorskip("PIL.Image")
GEMMA3 = {
    "size": {"height": 896, "width": 896},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
}
PAN_AND_SCAN = {
    **GEMMA3,
    "size": {"height": 128, "width": 128},
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 64,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
SIZES = [(1, 1), (50, 70), (224, 224), (300, 100), (100, 300), (130, 600), (1000, 190), (480, 640), (64, 1000)]


def reference(config: dict):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(**config)


@pytest.mark.parametrize("config", [GEMMA3, PAN_AND_SCAN], ids=["gemma3", "pan_and_scan"])
def test_pixels_equal_transformers(config):
    ours, theirs = GemmaImageConfig.from_dict(config), reference(config)
    rng = np.random.default_rng(0)
    crops_seen = set()
    for h, w in SIZES:
        image = PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")
        want = theirs(images=[image], return_tensors="np")
        got = preprocess(image, ours)
        assert got.shape[0] == 1 + want["num_crops"][0], (h, w)
        np.testing.assert_array_equal(got, want["pixel_values"], err_msg=f"{h}x{w}")
        crops_seen.add(got.shape[0] - 1)
    assert crops_seen == ({0} if not config.get("do_pan_and_scan") else {0, 2, 3, 4})


def test_crops_tile_the_long_side():
    config = GemmaImageConfig.from_dict(PAN_AND_SCAN)
    crops = pan_and_scan_crops(100, 300, config)
    assert crops == [(0, 0, 100, 100), (0, 100, 100, 100), (0, 200, 100, 100)]
    assert pan_and_scan_crops(100, 110, config) == []  # near square
    assert pan_and_scan_crops(40, 400, config) == []  # crops under the minimum side
