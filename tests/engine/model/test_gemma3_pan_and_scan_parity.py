"""Gemma 3 with pan and scan in its processor config against transformers' Gemma3ForConditionalGeneration in float32
on a tiny random checkpoint (vision_checkpoints.py, with the baked tokenizer's whole vocabulary for the text the
engine writes around the crops): a wide image (two crops) and a square one (none) through the engine, chunked, give
transformers' prompt log-probabilities and greedy answer for the same ids and its own pixels (the original, then the
crops, each its own image). The ids themselves are held to Gemma3Processor in tests/engine/core/test_pan_and_scan.py."""

from __future__ import annotations

import io

import pytest
import torch

from engine.core.images.intake import image_runs
from engine.sample.params import SamplingParams
from tests.engine.model.family_parity import tiny_engine
from tests.engine.model.vision_checkpoints import (
    BOI,
    EOI,
    IMAGE,
    SIZE,
    TOKENS,
    build_vision_model,
    hf_greedy,
    image_file,
    images,
)

PAN_AND_SCAN = {
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 32,
    "pan_and_scan_max_num_crops": 3,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
FILES = [image_file(90, 40, 4), image_file(60, 60, 5, "JPEG")]  # wide: two 45x40 crops; square: none
VOCAB = 49152


def _hf_logits(hf, tokens: list[int], files: list[bytes]) -> torch.Tensor:
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE}, **PAN_AND_SCAN)
    pixels = processor([Image.open(io.BytesIO(f)).convert("RGB") for f in files], return_tensors="pt")["pixel_values"]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits[0].float()


@pytest.fixture(scope="module")
def vision(tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("gemma3_pan_and_scan")
    return build_vision_model(path, baked_model_path, vocab_size=VOCAB, **PAN_AND_SCAN), path


def test_prompt_logprobs_and_greedy_equal_transformers(vision):
    hf, path = vision
    engine = tiny_engine(path, max_num_batched_tokens=24, num_kv_pages=96)
    encode = engine.tokenizer.encode
    span = [BOI] + [IMAGE] * TOKENS + [EOI]  # as the worker writes each image (the template's text around it)
    rendered = (
        encode("<|im_start|>user\n\n\n", add_special_tokens=False)
        + span
        + encode("\n\nWhat are these two?\n\n", add_special_tokens=False)
        + span
        + encode("\n\n<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    )
    prompt, _ = engine.images.expand(rendered, images(FILES))
    assert len(image_runs(prompt, IMAGE)) == 4 and len(prompt) > len(rendered) + 3 * len(span)
    assert "Here is the original image" in engine.tokenizer.decode(prompt)

    engine.add_request(
        "r", rendered, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3), images(FILES)
    )
    first, answer = None, []
    while engine.has_unfinished():
        for o in engine.step():
            first = first or o
            answer += o.outputs[0].token_ids
    assert engine.runner.num_images_encoded == 4
    got = first.prompt_logprobs[1:]
    assert [p.chosen.token_id for p in got] == prompt[1:]
    want = torch.log_softmax(_hf_logits(hf, prompt, FILES), dim=-1)
    chosen = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor([p.chosen.logprob for p in got]), chosen, atol=1e-4, rtol=1e-4)
    top = want[:-1].topk(3, dim=-1)
    assert [[t.token_id for t in p.top] for p in got] == top.indices.tolist()
    assert first.prompt_token_ids == prompt and first.num_prompt_tokens == len(prompt)  # usage counts the crops
    assert answer == hf_greedy(hf, prompt, FILES, 4, logits=_hf_logits)
