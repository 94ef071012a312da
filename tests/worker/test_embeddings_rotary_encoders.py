"""/v1/embeddings on workers baked from tiny random ModernBertModel and NomicBertModel folders (mean pooling, as
modernbert-embed and nomic-embed ship): the official `openai` client's vectors equal transformers' mean over the
tokens, normalised, for inputs longer than ModernBERT's local window, alone or batched; NomicBert with
`is_matryoshka` shortens to `dimensions` as the model was trained to, and an encoder without it refuses them."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
from local_worker import start_worker, stop_worker

from tests.encoders import add_mean_pooling, build_encoder

TEXTS = [
    "A man is eating food.",
    "Hello world",
    "Rotary encoders embed sentences of several lengths, some longer than the local attention window of sixteen.",
]


@pytest.fixture(scope="module", params=["ModernBertModel", "NomicBertModel"])
def encoder(request, tmp_path_factory):
    from builder.bake import bake
    from builder.sources import resolve

    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    # nomic-embed-text-v1.5's trained sizes: the config says so where the model may be shortened
    hf = build_encoder(arch, folder / "src", **({"is_matryoshka": True} if arch == "NomicBertModel" else {}))
    add_mean_pooling(folder / "src")
    bake(resolve(str(folder / "src"), None), folder / "model", served_name="tiny")
    w = start_worker(folder / "model", folder / "worker.log", DTYPE="float32", MAX_MODEL_LEN="256")
    yield arch, w, hf
    stop_worker(w)


def recipe(hf, texts: list[str]) -> np.ndarray:
    """sentence-transformers' Pooling (mean over the attention mask) then Normalize, on transformers' model."""
    from transformers import AutoTokenizer

    from tests.encoders import minilm_path

    batch = AutoTokenizer.from_pretrained(minilm_path())(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


def test_the_openai_client_gets_transformers_embeddings(encoder) -> None:
    _, w, hf = encoder
    client = w.client()
    want = recipe(hf, TEXTS)
    batched = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert batched.usage.prompt_tokens > 30  # the longest input is past ModernBERT's window
    for i, text in enumerate(TEXTS):
        got = np.array(batched.data[i].embedding)
        np.testing.assert_allclose(got, want[i], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(decoded.data[i].embedding, batched.data[i].embedding)
        alone = client.embeddings.create(model="tiny", input=text, encoding_format="float").data[0].embedding
        np.testing.assert_allclose(alone, got, atol=1e-6, rtol=0)


def test_dimensions_only_where_the_config_says_matryoshka(encoder) -> None:
    arch, w, hf = encoder
    client = w.client()
    if arch != "NomicBertModel":
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16)
        return
    full = recipe(hf, TEXTS[:1])[0]
    short = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16, encoding_format="float")
    want = full[:16] / np.linalg.norm(full[:16])  # the unnormalised mean, cut, then normalised: the same direction
    np.testing.assert_allclose(short.data[0].embedding, want, atol=1e-5, rtol=0)
