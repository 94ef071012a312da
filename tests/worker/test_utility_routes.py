"""vLLM's utility routes on the local endpoint and as jobs: /tokenize, /detokenize and /metrics (Prometheus)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai_schema import validate
from prometheus_client.parser import text_string_to_metric_families

Q = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox jumps over the lazy dog. Ünïcödé 日本語"


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return validate(response.json())["error"]


@pytest.mark.parametrize("path", ["/tokenize", "/openai/v1/tokenize", "/v2/e/openai/v1/tokenize"])
@pytest.mark.parametrize("special", [True, False])
def test_tokenize_a_prompt_equals_the_tokenizer(http, tokenizer, path, special) -> None:
    body = {"prompt": PROMPT, "add_special_tokens": special, "return_token_strs": True}
    answer = http.post(path, json=body).json()
    ids = tokenizer(PROMPT, add_special_tokens=special)["input_ids"]
    assert answer == {
        "count": len(ids),
        "max_model_len": 2048,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    # Without return_token_strs, none; the served names and the baked one are all accepted.
    plain = http.post(path, json={"model": "test-org/alias-name", "prompt": PROMPT}).json()
    assert plain["tokens"] == tokenizer(PROMPT)["input_ids"] and plain["token_strs"] is None


def test_tokenize_chat_counts_what_a_chat_completion_runs(http, client, model_name, tokenizer) -> None:
    completion = client.chat.completions.create(model=model_name, messages=Q, max_tokens=1, temperature=0)
    counted = http.post("/tokenize", json={"model": model_name, "messages": Q, "return_token_strs": True}).json()
    assert counted["count"] == completion.usage.prompt_tokens == len(counted["tokens"])
    assert counted["token_strs"] == tokenizer.convert_ids_to_tokens(counted["tokens"])
    # vLLM's chat defaults: the generation prompt is added; without it the prompt is shorter.
    bare = http.post("/tokenize", json={"messages": Q, "add_generation_prompt": False}).json()
    assert bare["tokens"] == counted["tokens"][: bare["count"]] and bare["count"] < counted["count"]


def test_tokenize_round_trips_through_detokenize(http, tokenizer) -> None:
    ids = http.post("/openai/v1/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    assert http.post("/openai/v1/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    # Special tokens are decoded as they are, as vLLM does.
    special = [tokenizer.eos_token_id, *ids]
    assert http.post("/detokenize", json={"tokens": special}).json()["prompt"] == tokenizer.eos_token + PROMPT


def test_bad_bodies_are_400_and_serving_goes_on(http, tokenizer) -> None:
    assert _error(http.post("/tokenize", json={"add_special_tokens": True}), 400)["param"] == "prompt"
    both = _error(http.post("/tokenize", json={"prompt": "x", "messages": Q}), 400)
    assert "either prompt or messages" in both["message"]
    assert _error(http.post("/tokenize", json={"messages": []}), 400)["param"] == "messages"
    assert _error(http.post("/tokenize", json={"messages": [{"content": 5}]}), 400)["param"].startswith("messages")
    assert _error(http.post("/detokenize", json={"tokens": [1, "a"]}), 400)["param"] == "tokens.[1]"
    assert _error(http.post("/detokenize", json={"tokens": [1, 2.5]}), 400)["param"] == "tokens.[1]"
    past = _error(http.post("/detokenize", json={"tokens": [1, len(tokenizer)]}), 400)
    assert past["param"] == "tokens.[1]" and "vocabulary" in past["message"]
    assert _error(http.post("/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens.[0]"
    assert _error(http.post("/tokenize", content=b"{"), 400)["message"].startswith("We could not parse")
    for path, body in (
        ("/tokenize", {"model": "nope", "prompt": "x"}),
        ("/detokenize", {"model": "nope", "tokens": []}),
    ):
        assert _error(http.post(path, json=body), 404)["code"] == "model_not_found"
    assert http.post("/tokenize", json={"prompt": "still here"}).json()["count"] > 0


def test_job_routes_through_the_handler(http, tokenizer) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    for route in ("/tokenize", "/v1/tokenize", "/openai/v1/tokenize"):
        job = {"openai_route": route, "openai_input": {"prompt": PROMPT}}
        result = http.post("/v2/e/runsync", json={"input": job}).json()
        assert result["status"] == "COMPLETED" and result["output"][0]["tokens"] == ids
    for route in ("/detokenize", "/v1/detokenize"):
        job = {"openai_route": route, "openai_input": {"tokens": ids}}
        assert http.post("/v2/e/runsync", json={"input": job}).json()["output"] == [{"prompt": PROMPT}]
    bad = {"openai_route": "/v1/detokenize", "openai_input": {"tokens": [len(tokenizer)]}}
    failed = http.post("/v2/e/runsync", json={"input": bad}).json()
    assert failed["status"] == "FAILED" and failed["error"]["param"] == "tokens.[0]"
    metrics = http.post("/v2/e/runsync", json={"input": {"openai_route": "/metrics"}}).json()
    assert any(name == "vllm:num_requests_running" for name, _ in _samples(metrics["output"][0]))


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_move_with_a_completion(http, client, model_name) -> None:
    labels = (("model_name", model_name),)
    scrape = http.get("/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    before = _samples(scrape.text)
    completion = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=5, temperature=0)
    after = _samples(http.get("/openai/v1/metrics").text)

    def moved(name: str, extra: tuple = ()) -> float:
        key = (name, tuple(sorted(labels + extra)))
        return after[key] - before.get(key, 0.0)

    usage = completion.usage
    reason = (("finished_reason", completion.choices[0].finish_reason),)
    assert moved("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == usage.completion_tokens == 5
    assert moved("vllm:request_success_total", reason) == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") >= 1  # once per output after the first, not per token
    assert after[("vllm:num_requests_running", labels)] == 0
    assert 0.0 <= after[("vllm:kv_cache_usage_perc", labels)] <= 1.0


def test_metrics_count_prefix_cache_hits_and_preemptions(http, client, model_name) -> None:
    """A prompt sent twice: the second finds its full pages in the prefix cache; the counters move as usage says."""
    labels = (("model_name", model_name),)
    prompt = " ".join(f"Line {i} of a long shared preamble." for i in range(40))
    client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
    before = _samples(http.get("/metrics").text)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
    after = _samples(http.get("/metrics").text)

    def moved(name: str) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert moved("vllm:prefix_cache_queries_total") == second.usage.prompt_tokens
    assert moved("vllm:prefix_cache_hits_total") == cached
    assert ("vllm:num_preemptions_total", labels) in after  # the engine's count, read when scraped


def test_metrics_need_the_api_key_unless_public(custom_worker) -> None:
    assert _error(httpx.get(custom_worker.url("/metrics")), 401)["message"].startswith("You didn't provide")
    assert _error(httpx.post(custom_worker.url("/tokenize"), json={"prompt": "x"}), 401)
    key = {"Authorization": "Bearer test-secret"}
    scraped = httpx.get(custom_worker.url("/metrics"), headers=key)
    assert ("vllm:num_requests_waiting", (("model_name", "custom-name"),)) in _samples(scraped.text)
    assert httpx.post(custom_worker.url("/openai/v1/tokenize"), json={"prompt": "x"}, headers=key).json()["count"]


def test_metrics_public_opens_metrics_and_nothing_else() -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from worker.http_guards import ApiKeyGuard

    def ok(request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok) for p in ("/metrics", "/openai/v1/metrics", "/tokenize", "/health")])
    guarded = ApiKeyGuard(app, key="k", open_routes=("/health", "/metrics"))
    with TestClient(guarded) as open_client:
        assert [open_client.get(p).status_code for p in ("/metrics", "/openai/v1/metrics", "/health")] == [200] * 3
        assert open_client.get("/tokenize").status_code == 401


def test_add_special_tokens_follows_the_tokenizers_template(baked_model_path, tmp_path) -> None:
    """The baked tokenizer adds no special token to a prompt; one whose post-processor adds a BOS shows the flag."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    from engine.text.tokenizer import Tokenizer
    from worker.openai.tokenize import prepare_tokenize, tokenize

    backend = Backend.from_file(str(baked_model_path / "tokenizer.json"))
    bos = backend.token_to_id("<|endoftext|>")
    backend.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    backend.save(str(tmp_path / "tokenizer.json"))

    class Served:
        tokenizer = Tokenizer.from_folder(tmp_path)
        max_model_len = 2048

    def tokens(body: dict) -> list[int]:
        return asyncio.run(tokenize(prepare_tokenize(body, Served())))["tokens"]

    plain = backend.encode(PROMPT, add_special_tokens=False).ids
    assert tokens({"prompt": PROMPT}) == [bos, *plain]
    assert tokens({"prompt": PROMPT, "add_special_tokens": False}) == plain
