"""A tiny Qwen3-VL and a tiny Qwen2.5-VL model, each baked by the builder (vision_bake.py), answer chat requests with
image parts through the local endpoint and the official openai client: the template's
<|vision_start|><|image_pad|><|vision_end|> widened to the image's merged patches (usage counts them exactly), whole
and streamed alike, the image moving the answer's logprobs, the same image in a later turn served from the prefix
cache; the Responses API's input_image too, Anthropic's count_tokens counting the widened pad, and a native job's
messages."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from anthropic_client import held_to_the_schema, sdk  # noqa: F401 (a fixture, used by name)
from local_worker import LocalWorker, start_worker, stop_worker
from vision_bake import (
    QWEN_VL_TOWERS,
    ask,
    bake_qwen_vl_model,
    check_image_moves_the_answer,
    check_whole_and_streamed,
    data_url,
    png,
)

RED, BLUE = png(80, 40, (200, 30, 30)), png(30, 70, (20, 40, 220), "JPEG")
RED_TOKENS = 10  # 80x40 -> 80x32 pixels: 10 x 4 patches of 8, merged 2x2 (Qwen2.5-VL: windows of 2x2 cut short)


@pytest.fixture(scope="module", params=list(QWEN_VL_TOWERS))
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def name(model_type: str) -> str:
    """The served model's name (its bake's folder)."""
    return QWEN_VL_TOWERS[model_type][0]


@pytest.fixture(scope="module")
def qwen_vl_worker(
    model_type: str, baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalWorker]:
    root = tmp_path_factory.mktemp(model_type)
    out = bake_qwen_vl_model(baked_model_path, root, model_type)
    w = start_worker(out, root / "worker.log", MAX_MODEL_LEN="512", MAX_IMAGES_PER_REQUEST="2")
    yield w
    stop_worker(w)


def test_an_image_part_whole_and_streamed_counts_its_tokens(qwen_vl_worker: LocalWorker, name: str) -> None:
    check_whole_and_streamed(qwen_vl_worker.client(), name, data_url(RED), RED_TOKENS)


def test_the_image_moves_the_answer_and_a_later_turn_hits_the_cache(qwen_vl_worker: LocalWorker, name: str) -> None:
    check_image_moves_the_answer(
        qwen_vl_worker.client(),
        name,
        lambda url: ask(url, "Describe it."),
        data_url(RED),
        data_url(BLUE, "image/jpeg"),
        RED_TOKENS,
    )


def test_a_responses_input_image(qwen_vl_worker: LocalWorker, name: str) -> None:
    sdk = qwen_vl_worker.client()
    response = sdk.responses.create(
        model=name,
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
    chat = sdk.chat.completions.create(model=name, messages=ask(data_url(RED)), max_tokens=6, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_count_tokens_counts_the_image_tokens(qwen_vl_worker: LocalWorker, name: str) -> None:
    """/v1/messages/count_tokens through the anthropic client: an image block counts the tokens the engine widens
    its pad to, as /v1/messages' usage does."""
    claude = sdk(qwen_vl_worker)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()},
    }
    content = [image, {"type": "text", "text": "What is in the picture?"}]
    plain = claude.messages.count_tokens(model=name, messages=[{"role": "user", "content": content[1:]}])
    counted = claude.messages.count_tokens(model=name, messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == plain.input_tokens + RED_TOKENS + 2
    ran = claude.messages.create(model=name, max_tokens=2, messages=[{"role": "user", "content": content}])
    assert ran.usage.input_tokens == counted.input_tokens  # (no cache_control: every prompt token is input)


def test_a_native_job_takes_image_parts(qwen_vl_worker: LocalWorker, name: str) -> None:
    with qwen_vl_worker.http() as http:
        body = {"input": {"messages": ask(data_url(RED)), "sampling_params": {"max_tokens": 6, "temperature": 0}}}
        out = http.post("/v2/test-endpoint/runsync", json=body).json()
    chat = qwen_vl_worker.client().chat.completions.create(
        model=name, messages=ask(data_url(RED)), max_tokens=6, temperature=0
    )
    assert out["status"] == "COMPLETED", out
    assert "".join(out["output"][0]["choices"][0]["tokens"]) == chat.choices[0].message.content


def test_tokenize_counts_the_image_tokens(qwen_vl_worker: LocalWorker, name: str) -> None:
    """vLLM's /tokenize widens the image's pad as the engine does: its count is the chat completion's prompt."""
    messages = ask(data_url(RED))
    plain = [{"role": "user", "content": "What is in the picture?"}]
    with qwen_vl_worker.http() as http:
        counted = http.post("/tokenize", json={"model": name, "messages": messages}).json()
        without = http.post("/tokenize", json={"model": name, "messages": plain}).json()
    assert counted["count"] == len(counted["tokens"]) == without["count"] + RED_TOKENS + 2
    ran = qwen_vl_worker.client().chat.completions.create(model=name, messages=messages, max_tokens=1)
    assert ran.usage.prompt_tokens == counted["count"]
