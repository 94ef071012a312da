"""POST /v1/embeddings through the local endpoint with the official `openai` SDK (float and base64), on the baked
default model and on tiny random models with mean and last-token pooling, against transformers' final hidden states
pooled the same way; through /openai/v1, /v2/<id>/openai/v1 and a RunPod job; bad inputs are 400s."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from local_worker import start_worker, stop_worker

ATOL = 1e-4
TEXTS = ["Hello there, how are you?", "The quick brown fox jumps over the lazy dog.", "x"]


def pooled(model_path: Path, tokenizer, text: str, method: str) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = tokenizer.encode(text)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    vector = hidden.mean(0) if method == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=-1).numpy()


def as_floats(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<f4")


def check_against_transformers(client: openai.OpenAI, model: str, model_path: Path, method: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    # The SDK's own default asks for base64 and decodes it; a raw base64 answer is the same float32 bytes.
    decoded = client.embeddings.create(model=model, input=TEXTS)
    raw = client.embeddings.with_raw_response.create(model=model, input=TEXTS, encoding_format="base64")
    raw_data = json.loads(raw.http_response.text)["data"]
    for i, text in enumerate(TEXTS):
        want = pooled(model_path, tokenizer, text, method)
        np.testing.assert_allclose(floats.data[i].embedding, want, atol=ATOL, rtol=0)
        np.testing.assert_allclose(decoded.data[i].embedding, floats.data[i].embedding, atol=0, rtol=0)
        np.testing.assert_array_equal(as_floats(raw_data[i]["embedding"]), np.float32(floats.data[i].embedding))
        alone = client.embeddings.create(model=model, input=text, encoding_format="float").data[0].embedding
        np.testing.assert_allclose(alone, floats.data[i].embedding, atol=1e-6, rtol=0)  # a batch equals each alone


def test_default_model_matches_transformers(client, model_name, baked_model_path) -> None:
    check_against_transformers(client, model_name, baked_model_path, "last")


@pytest.fixture(scope="module", params=["mean", "last"])
def tiny_worker(request, tmp_path_factory, baked_model_path):
    """A tiny random Llama on the default tokenizer, baked with (mean) or without (last) sentence-transformers files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from builder.bake import bake
    from builder.sources import resolve

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    source = folder / "source"
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(baked_model_path / name, source / name)
    if request.param == "mean":
        (source / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
                ]
            )
        )
        (source / "1_Pooling").mkdir()
        (source / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    bake(resolve(str(source), None), folder / "model", served_name="tiny")
    w = start_worker(folder / "model", folder / "worker.log")
    yield request.param, folder / "model", w
    stop_worker(w)


def test_tiny_models_pool_as_their_files_say(tiny_worker) -> None:
    method, path, w = tiny_worker
    check_against_transformers(w.client(), "tiny", path, method)


def test_every_door_gives_the_same_embedding(client, http, worker, model_name) -> None:
    want = client.embeddings.create(model=model_name, input="door", encoding_format="float").data[0].embedding
    body = {"model": model_name, "input": "door", "user": "someone"}
    plain = http.post("/openai/v1/embeddings", json=body).json()
    job = http.post("/v2/e/runsync", json={"input": {"openai_route": "/v1/embeddings", "openai_input": body}}).json()
    assert job["status"] == "COMPLETED"
    for answer in (plain, job["output"][0]):
        assert answer["object"] == "list" and answer["model"] == model_name
        np.testing.assert_allclose(answer["data"][0]["embedding"], want, atol=1e-6, rtol=0)


def test_token_id_inputs_equal_their_text(client, model_name, tokenizer) -> None:
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=model_name, input=TEXTS[:2], encoding_format="float")
    by_ids = client.embeddings.create(model=model_name, input=ids, encoding_format="float")
    one = client.embeddings.create(model=model_name, input=ids[0], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6, rtol=0)
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, atol=1e-6, rtol=0)


def test_embeddings_while_a_chat_streams_change_neither(client, model_name) -> None:
    chat = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 40,
        "temperature": 0,
    }
    solo_text = client.chat.completions.create(**chat).choices[0].message.content
    solo = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float")
    parts = []
    with client.chat.completions.create(**chat, stream=True) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if len(parts) == 1:  # the chat is decoding now: the embeddings join its steps
                    during = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float")
    assert "".join(parts) == solo_text
    for a, b in zip(during.data, solo.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["ok", 3]}, "input"),
        ({"input": [[1, 2], "text"]}, "input"),
        ({"input": [5, -1]}, "input"),
        ({"input": [10**7]}, "input"),
        ({"input": "word " * 2100}, "input"),
        ({"input": "hi", "dimensions": 16}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "stream": True}, "stream"),
        ({"input": "hi", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
        ({}, "input"),
    ],
)
def test_bad_inputs_are_400s_naming_the_field(http, model_name, body, param) -> None:
    answer = http.post("/openai/v1/embeddings", json={"model": model_name, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, http, model_name, tokenizer) -> None:
    ids = tokenizer.encode("word " * 2100)
    answer = http.post(
        "/openai/v1/embeddings",
        json={"model": model_name, "input": "word " * 2100, "truncate_prompt_tokens": 100, "encoding_format": "float"},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 100
    tail = client.embeddings.create(model=model_name, input=ids[-100:], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(answer.json()["data"][0]["embedding"], tail, atol=1e-6, rtol=0)
    whole = http.post(
        "/openai/v1/embeddings", json={"model": model_name, "input": "word " * 2100, "truncate_prompt_tokens": -1}
    ).json()
    assert whole["usage"]["prompt_tokens"] == 2048
