"""Gemma 3's pan and scan (engine/core/images/pan_and_scan.py through ImageIntake): the prompt ids and pixel values the
engine builds for a wide image (crops), a square one (none) and a tall one equal what transformers' Gemma3Processor
gives for the same text and images, with SmolLM2's tokenizer (whose merges cross the text around an image) given
Gemma 3's image tokens."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from engine.core.images.intake import ImageIntake, image_runs
from engine.inputs import ImageData
from engine.model.vision.spec import VisionSpec
from tests.engine.image.test_gemma_preprocess import PAN_AND_SCAN

PIL = pytest.importorskip("PIL.Image")
TOKENS = 4
SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TEXTS = [
    "<|im_start|>user\n<start_of_image>What is in these?<start_of_image><start_of_image> Say.<|im_end|>\n",
    "<start_of_image>\n<start_of_image>",
]


def _picture(width: int, height: int, seed: int):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")


def _file(picture) -> bytes:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def gemma3_tokenizer(tmp_path_factory, baked_model_path):
    import transformers as tf

    path = tmp_path_factory.mktemp("pan_and_scan")
    tokenizer = tf.AutoTokenizer.from_pretrained(baked_model_path, extra_special_tokens=SPECIAL)
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PAN_AND_SCAN))
    return path, tokenizer


def _intake(path) -> tuple[ImageIntake, list[int]]:
    from engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(path)
    boi, image, eoi = tokenizer.convert_tokens_to_ids(
        [SPECIAL["boi_token"], SPECIAL["image_token"], SPECIAL["eoi_token"]]
    )
    vision = VisionSpec(
        image_token_id=image,
        tokens_per_image=TOKENS,
        image_size=PAN_AND_SCAN["size"]["height"],
        boi_token_id=boi,
        eoi_token_id=eoi,
        bidirectional=True,
    )
    return ImageIntake(vision, str(path), tokenizer, max_chunk=512), tokenizer


@pytest.mark.parametrize("text", TEXTS, ids=["chat", "adjacent"])
def test_ids_and_pixels_equal_gemma3_processor(gemma3_tokenizer, text):
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path, hf_tokenizer = gemma3_tokenizer
    pictures = [_picture(300, 100, 1), _picture(120, 120, 2), _picture(90, 250, 3)][: text.count("<start_of_image>")]
    processor = tf.Gemma3Processor(Gemma3ImageProcessorPil(**PAN_AND_SCAN), hf_tokenizer, image_seq_length=TOKENS)
    # the processor's own defaults (no pan and scan, 256-pixel crops) win over its image processor's: pass them
    settings = {k: v for k, v in PAN_AND_SCAN.items() if "pan_and_scan" in k}
    want = processor(text=[text], images=[pictures], return_tensors="pt", **settings)
    assert want["pixel_values"].shape[0] > len(pictures)  # the wide image (and the tall one) gave crops

    intake, tokenizer = _intake(path)
    # the worker's side: the template's boi written as the full image sequence (ImagePrompt), then tokenized
    rendered = tokenizer.encode(text.replace(intake.prompt.placeholder, intake.prompt.expansion))
    files = [ImageData(_file(p), f"image {i}") for i, p in enumerate(pictures)]
    ids, decoded = intake.expand(rendered, files)
    assert ids == want["input_ids"][0].tolist()
    spans = intake.spans(ids, decoded)
    torch.testing.assert_close(torch.stack([s.pixels for s in spans]), want["pixel_values"], atol=0, rtol=0)
    assert [s.end - s.start for s in spans] == [TOKENS] * len(spans)
    assert [d.param for d in decoded][:4] == ["image 0"] * 4  # the wide one's crops are named as it
    # a prompt widened already (transformers' own ids) runs as it is
    assert intake.expand(ids, files)[0] == ids


def test_images_without_crops_keep_the_prompt(gemma3_tokenizer):
    path, _ = gemma3_tokenizer
    intake, tokenizer = _intake(path)
    rendered = tokenizer.encode(TEXTS[1].replace(intake.prompt.placeholder, intake.prompt.expansion))
    files = [ImageData(_file(_picture(120, 110, 4))), ImageData(_file(_picture(100, 100, 5)))]
    ids, decoded = intake.expand(rendered, files)
    assert ids == rendered and len(decoded) == 2
    assert len(image_runs(ids, intake.vision.image_token_id)) == 2
