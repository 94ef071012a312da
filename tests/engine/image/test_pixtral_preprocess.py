"""Pixtral image preprocessing for Mistral 3 (engine/image/pixtral.py) held to transformers' PixtralImageProcessorPil
with the patch Mistral 3's PixtralProcessor passes it (patch_size * spatial_merge_size), value for value: images of
many sizes (tiny, thin strips either way, larger than the longest edge, not multiples of the patch), the grid, the
token count and the prompt layout (rows of image tokens, a break after each, the end token last) the processor's."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.images.broken_rows import BrokenRowsPrompt
from engine.errors import InvalidRequest
from engine.image.pixtral import PixtralImageConfig, preprocess
from engine.model.vision.spec import BrokenRows

PIL = pytest.importorskip("PIL.Image")
CONFIGS = {  # (patch_size * spatial_merge_size, preprocessor_config.json)
    "mistral_small": (28, {"size": {"longest_edge": 1540}}),
    "default": (32, {}),
    "tiny_tower": (8, {"size": {"longest_edge": 64}}),
}
SIZES = [(1, 1), (5, 700), (700, 5), (33, 57), (100, 100), (224, 640), (1080, 1920), (2000, 150)]


def random_image(height: int, width: int, seed: int):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")


def reference_layout(size: tuple[int, int], merged_patch: int) -> str:
    """PixtralProcessor.replace_image_token's rows for an image of `size` pixels (its module needs torchvision, which
    is not installed: its few lines, with I, B, E for the image, break and end tokens)."""
    rows = [["I"] * (size[1] // merged_patch) + ["B"]] * (size[0] // merged_patch)
    tokens = [t for row in rows for t in row]
    tokens[-1] = "E"
    return "".join(tokens)


def reference_count(height: int, width: int, merged: int, longest_edge: int) -> int:
    """PixtralProcessor._get_num_multimodal_tokens for an image of height x width."""
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    h, w = get_resize_output_image_size(
        np.zeros((3, height, width)), (longest_edge,) * 2, (merged, merged), "channels_first"
    )
    return (w // merged + 1) * (h // merged)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pixels_grid_and_layout_equal_transformers(name):
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    merged, raw = CONFIGS[name]
    ours = PixtralImageConfig.from_dict(raw, merged)
    theirs = PixtralImageProcessorPil(**raw)
    layout = BrokenRowsPrompt(BrokenRows(patch_size=merged, merge_size=1, break_token_id=1, end_token_id=2), 0)
    for i, (h, w) in enumerate(SIZES):
        image = random_image(h, w, seed=i)
        if min(h, w) * ours.longest_edge < max(h, w):  # a side shrinks to nothing: both refuse it
            with pytest.raises(ValueError):
                theirs(images=[image], patch_size={"height": merged, "width": merged})
            with pytest.raises(InvalidRequest):
                preprocess(image, ours)
            continue
        want = theirs(images=[image], patch_size={"height": merged, "width": merged}, return_tensors="np")
        got = preprocess(image, ours)
        assert got.pixel_values.dtype == np.float32
        np.testing.assert_array_equal(got.pixel_values, want["pixel_values"][0], err_msg=f"{h}x{w}")
        size = tuple(int(x) for x in want["image_sizes"][0])
        assert got.grid == (size[0] // merged, size[1] // merged), (h, w)
        tokens = "".join("IBE"[t] for t in layout.layout(got.grid))
        assert tokens == reference_layout(size, merged), (h, w)
        assert got.num_tokens == len(tokens) == reference_count(h, w, merged, ours.longest_edge), (h, w)


def test_runs_find_whole_layouts_and_lone_placeholders():
    layout = BrokenRowsPrompt(BrokenRows(patch_size=4, merge_size=2, break_token_id=12, end_token_id=13), 10)
    image = layout.layout((2, 3))
    assert image == [10, 10, 10, 12, 10, 10, 10, 13]
    prompt = [1, 10, 2, *image, 3, 10, 10, 4, *layout.layout((1, 1))]
    assert layout.runs(prompt) == [(1, 2), (3, 11), (12, 13), (13, 14), (15, 17)]
