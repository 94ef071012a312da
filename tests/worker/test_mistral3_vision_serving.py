"""A tiny Mistral 3 image-text model baked by the builder (vision_bake.py) answers chat requests with image parts
through the local endpoint and the official openai client: the template's [IMG] widened to the image's rows of [IMG]
each closed by [IMG_BREAK], the last by [IMG_END] (usage counts them exactly), whole and streamed alike, the image
moving the answer's logprobs, the same image in a later turn served from the prefix cache; the other doors (the
Responses API's input_image, Anthropic Messages' image blocks, a native job's messages) give the chat's answer."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_worker import ENDPOINT, LocalWorker, start_worker, stop_worker
from vision_bake import (
    ask,
    bake_mistral3_model,
    check_image_moves_the_answer,
    check_whole_and_streamed,
    data_url,
    png,
)

RED, BLUE = png(60, 60, (200, 30, 30)), png(30, 70, (20, 40, 220), "JPEG")
RED_TOKENS = 72  # 60x60 -> 64x64 pixels: 8 rows of 8 merged patches, each row closed by a break (the last: end)
NAME = "tiny-mistral3"


@pytest.fixture(scope="module")
def mistral3_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    root = tmp_path_factory.mktemp("mistral3-vision")
    out = bake_mistral3_model(baked_model_path, root)
    w = start_worker(out, root / "worker.log", MAX_MODEL_LEN="512", MAX_IMAGES_PER_REQUEST="2")
    yield w
    stop_worker(w)


def test_an_image_part_whole_and_streamed_counts_its_tokens(mistral3_worker: LocalWorker) -> None:
    # (the template's one [IMG] is replaced by the layout: nothing opens or closes it besides)
    check_whole_and_streamed(mistral3_worker.client(), NAME, data_url(RED), RED_TOKENS, around=0)


def test_the_image_moves_the_answer_and_a_later_turn_hits_the_cache(mistral3_worker: LocalWorker) -> None:
    check_image_moves_the_answer(
        mistral3_worker.client(),
        NAME,
        lambda url: ask(url, "Describe it."),
        data_url(RED),
        data_url(BLUE, "image/jpeg"),
        RED_TOKENS,
    )


def greedy_chat(worker: LocalWorker):
    return worker.client().chat.completions.create(model=NAME, messages=ask(data_url(RED)), max_tokens=6, temperature=0)


def test_a_responses_input_image(mistral3_worker: LocalWorker) -> None:
    response = mistral3_worker.client().responses.create(
        model=NAME,
        max_output_tokens=6,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(RED)},
                    {"type": "input_text", "text": "What is in the picture?"},
                ],
            }
        ],
    )
    chat = greedy_chat(mistral3_worker)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_anthropic_messages_take_an_image_block(mistral3_worker: LocalWorker) -> None:
    import anthropic

    claude = anthropic.Anthropic(base_url=mistral3_worker.url(f"{ENDPOINT}/openai"), api_key="unused", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "What is in the picture?"}]
    message = claude.messages.create(
        model=NAME, messages=[{"role": "user", "content": content}], max_tokens=6, extra_body={"temperature": 0}
    )
    chat = greedy_chat(mistral3_worker)
    assert message.content[0].text == chat.choices[0].message.content
    # Anthropic's input_tokens leave out the prompt tokens read from the cache
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_native_job_takes_image_parts(mistral3_worker: LocalWorker) -> None:
    with mistral3_worker.http() as http:
        body = {"input": {"messages": ask(data_url(RED)), "sampling_params": {"max_tokens": 6, "temperature": 0}}}
        out = http.post("/v2/test-endpoint/runsync", json=body).json()
    assert out["status"] == "COMPLETED", out
    assert "".join(out["output"][0]["choices"][0]["tokens"]) == greedy_chat(mistral3_worker).choices[0].message.content
