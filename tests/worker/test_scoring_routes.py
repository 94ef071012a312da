"""/v1/score, /v1/rerank and /v2/rerank through the local endpoint (httpx: the OpenAI SDK has no rerank) and as
RunPod jobs, on tiny random cross-encoders baked by the builder: a Qwen3ForSequenceClassification, Qwen3-Reranker's
yes/no layout, and the encoders' BertForSequenceClassification, XLMRobertaForSequenceClassification and
ModernBertForSequenceClassification (mean pooling, pairs past its local window). Scores equal transformers' for the
same pairs (tokenized as `tokenizer(text, text_pair)`, BERT's with its token_type_ids); bad
input, a pair past the model's length, score on a chat model and chat on a cross-encoder are clear errors."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from local_worker import ENDPOINT, start_worker, stop_worker

from tests.cross_encoders import (
    ENCODER_KINDS,
    build_cross_encoder,
    build_encoder_cross_encoder,
    encode_pair,
    encoder_reference_logits,
    reference_scores,
)

QUERY = "What is the capital of France?"
DOCS = [
    "Paris is the capital of France.",
    "Bananas are yellow.",
    "France borders Spain and Italy.",
    "The Eiffel Tower is in Paris.",
]
TOLERANCE = 1e-4  # float32 both sides; the worker runs in float32 (DTYPE)


@pytest.fixture(scope="module", params=["qwen3", "reranker", *ENCODER_KINDS])
def scorer(request, tmp_path_factory, baked_model_path):
    from transformers import AutoTokenizer

    from builder.bake import bake
    from builder.sources import resolve

    kind = request.param
    folder = tmp_path_factory.mktemp(f"scorer-{kind}")
    encoder = kind in ENCODER_KINDS
    if encoder:
        hf = build_encoder_cross_encoder(kind, folder / "source")
    else:
        hf = build_cross_encoder(kind, folder / "source", baked_model_path)
    bake(resolve(str(folder / "source"), None), folder / "model", served_name="tiny-scorer")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "model"))
    length = "128" if encoder else "512"  # the encoders' position tables hold 128 (BERT 130)
    w = start_worker(folder / "model", folder / "worker.log", DTYPE="float32", MAX_MODEL_LEN=length)

    def want(a: str, b: str) -> float:
        if encoder:  # the pair as the baked tokenizer joins it, BERT's token_type_ids given to transformers
            ids, types = encode_pair(folder / "model", a, b)
            return torch.sigmoid(encoder_reference_logits(hf, kind, ids, types)).item()
        [score] = reference_scores(hf, kind, tokenizer(a, text_pair=b)["input_ids"])
        return score

    with w.http() as http:
        yield http, want, w
    stop_worker(w)


def post(http, route: str, body: dict, status: int = 200) -> dict:
    reply = http.post(f"{ENDPOINT}/openai{route}", json={"model": "tiny-scorer", **body})
    assert reply.status_code == status, reply.text
    return reply.json()


def test_score_one_to_one_one_to_many_and_many_to_many(scorer) -> None:
    http, want, _ = scorer
    one = post(http, "/v1/score", {"text_1": QUERY, "text_2": DOCS[0]})
    assert set(one) == {"id", "object", "created", "model", "data", "usage"} and one["id"].startswith("score-")
    assert one["object"] == "list" and one["model"] == "tiny-scorer"
    assert one["data"] == [{"index": 0, "object": "score", "score": pytest.approx(want(QUERY, DOCS[0]), abs=TOLERANCE)}]
    many = post(http, "/v1/score", {"text_1": [QUERY], "text_2": DOCS})
    assert [d["score"] for d in many["data"]] == pytest.approx([want(QUERY, d) for d in DOCS], abs=TOLERANCE)
    assert len({round(d["score"], 6) for d in many["data"]}) == len(DOCS)
    pairs = post(http, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]})
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [want(DOCS[0], DOCS[2]), want(DOCS[1], DOCS[3])], abs=TOLERANCE
    )
    assert many["usage"]["prompt_tokens"] == many["usage"]["total_tokens"] > one["usage"]["prompt_tokens"]
    # vLLM's other names for the two sides
    aliased = post(http, "/v1/score", {"queries": QUERY, "documents": DOCS})
    assert [d["score"] for d in aliased["data"]] == pytest.approx([d["score"] for d in many["data"]], abs=1e-6)


def test_use_activation_false_gives_the_raw_logit(scorer) -> None:
    http, want, _ = scorer
    raw = post(http, "/v1/score", {"text_1": QUERY, "text_2": DOCS[1], "use_activation": False})["data"][0]["score"]
    assert 1 / (1 + math.exp(-raw)) == pytest.approx(want(QUERY, DOCS[1]), abs=TOLERANCE)


def test_rerank_orders_the_documents_by_relevance(scorer) -> None:
    http, want, _ = scorer
    scores = [want(QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    ranked = post(http, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert set(ranked) == {"id", "model", "usage", "results"} and ranked["id"].startswith("rerank-")
    assert [r["index"] for r in ranked["results"]] == order
    for r in ranked["results"]:
        assert r == {
            "index": r["index"],
            "document": {"text": DOCS[r["index"]]},
            "relevance_score": pytest.approx(scores[r["index"]], abs=TOLERANCE),
        }
    top = post(
        http,
        "/v1/rerank",
        {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False},
    )
    assert top["results"] == [
        {"index": i, "relevance_score": pytest.approx(scores[i], abs=TOLERANCE)} for i in order[:2]
    ]
    assert post(http, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 99})["results"] == ranked["results"]
    v2 = post(http, "/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3})
    assert v2["results"] == ranked["results"][:3] and v2["usage"] == ranked["usage"]


def test_score_and_rerank_as_runpod_jobs(scorer) -> None:
    http, want, _ = scorer
    for route, body, pick in (
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS[3]}, lambda o: o["data"][0]["score"]),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS[3:]}, lambda o: o["results"][0]["relevance_score"]),
    ):
        reply = http.post(
            "/v2/e/runsync", json={"input": {"openai_route": route, "openai_input": {"model": "tiny-scorer", **body}}}
        ).json()
        assert reply["status"] == "COMPLETED", reply
        assert pick(reply["output"][0]) == pytest.approx(want(QUERY, DOCS[3]), abs=TOLERANCE)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents.1"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "", "documents": DOCS}, "query"),
        ("/v1/rerank", {"documents": DOCS}, "query"),
        ("/v1/score", {"text_1": DOCS[:2], "text_2": DOCS}, "text_1"),
        ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": QUERY}, "text_2"),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "stream": True}, "stream"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(scorer, route, body, param) -> None:
    http, _, _ = scorer
    error = post(http, route, body, status=400)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_pair_past_the_models_length_is_a_400_not_truncated(scorer) -> None:
    http, _, _ = scorer
    long = " ".join(["word"] * 600)  # past 128 and 512 tokens
    for route, body in (
        ("/v1/score", {"text_1": QUERY, "text_2": long}),
        ("/v1/rerank", {"query": long, "documents": DOCS}),
    ):
        error = post(http, route, body, status=400)["error"]
        assert error["type"] == "invalid_request_error" and "maximum context length" in error["message"], error


def test_an_unknown_model_is_a_404(scorer) -> None:
    http, _, _ = scorer
    reply = http.post(f"{ENDPOINT}/openai/v1/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_a_cross_encoder_refuses_to_generate_or_embed(scorer) -> None:
    http, _, w = scorer
    client = w.client()
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="tiny-scorer", messages=[{"role": "user", "content": "Hi"}])
    assert "is a cross-encoder: it serves /v1/score" in chat.value.message and chat.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny-scorer", input="Hi")
    native = http.post("/runsync", json={"input": {"prompt": "Hi"}}).json()
    assert native["status"] == "FAILED" and "cross-encoder" in str(native["error"])


def test_score_on_a_chat_model_is_a_400(http, model_name) -> None:
    for route, body in (
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
        ("/v2/rerank", {"query": QUERY, "documents": DOCS}),
    ):
        reply = http.post(f"{ENDPOINT}/openai{route}", json={"model": model_name, **body})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "model" and "needs a cross-encoder" in reply.json()["error"]["message"]
