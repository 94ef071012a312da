"""A tiny Gemma 4 image-text model baked by the builder (vision_bake.py) answers chat requests with image parts
through the local endpoint and the official openai client: the template's <|image|> widened to <|image>, the image's
pooled patches, <image|> (usage counts them exactly), whole and streamed alike, the image moving the answer's
logprobs, the same image in a later turn served from the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from local_worker import LocalWorker, start_worker, stop_worker
from vision_bake import (
    ask,
    bake_gemma4_vision_model,
    check_image_moves_the_answer,
    check_whole_and_streamed,
    data_url,
    png,
)

RED, BLUE = png(80, 40, (200, 30, 30)), png(30, 70, (20, 40, 220), "JPEG")
RED_TOKENS = 55  # 80x40 -> 176x80 pixels: 22 x 10 patches of 8, pooled 2x2
NAME = "tiny-gemma4-vision"


@pytest.fixture(scope="module")
def gemma4_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    root = tmp_path_factory.mktemp("gemma4-vision")
    out = bake_gemma4_vision_model(baked_model_path, root)
    w = start_worker(out, root / "worker.log", MAX_MODEL_LEN="512", MAX_IMAGES_PER_REQUEST="2")
    yield w
    stop_worker(w)


def test_an_image_part_whole_and_streamed_counts_its_tokens(gemma4_worker: LocalWorker) -> None:
    check_whole_and_streamed(gemma4_worker.client(), NAME, data_url(RED), RED_TOKENS)


def test_the_image_moves_the_answer_and_a_later_turn_hits_the_cache(gemma4_worker: LocalWorker) -> None:
    check_image_moves_the_answer(
        gemma4_worker.client(),
        NAME,
        lambda url: ask(url, "Describe it."),
        data_url(RED),
        data_url(BLUE, "image/jpeg"),
        RED_TOKENS,
    )
