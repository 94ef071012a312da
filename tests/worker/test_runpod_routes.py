"""RunPod's job routes (/run, /runsync, /stream, /status, /cancel, /health), native jobs and output modes."""

from __future__ import annotations

import json
import time

from openai_schema import parse_sse, validate

Q = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_job(model: str, stream: bool, **kw) -> dict:
    body = {"model": model, "messages": Q, "max_tokens": 6, "temperature": 0, "stream": stream, **kw}
    return {"input": {"openai_route": "/v1/chat/completions", "openai_input": body}}


def sse_text(outputs: list[str]) -> str:
    events = parse_sse("".join(outputs))
    return "".join(validate(e)["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def test_runsync_stream_aggregate_equals_the_plain_answer(http, model_name) -> None:
    plain = http.post("/v2/e/runsync", json=_chat_job(model_name, False)).json()
    assert plain["status"] == "COMPLETED" and len(plain["output"]) == 1
    answer = validate(plain["output"][0])["choices"][0]["message"]["content"]
    streamed = http.post("/v2/e/runsync", json=_chat_job(model_name, True)).json()
    assert streamed["status"] == "COMPLETED" and all(isinstance(o, str) for o in streamed["output"])
    assert len(streamed["output"]) > 1  # grouped 1, 3, 9, ... chunks per yield
    assert sse_text(streamed["output"]) == answer


def test_models_route_arrives_with_an_empty_openai_input(http, model_name) -> None:
    for job in (
        {"openai_route": "/v1/models"},
        {"openai_route": "/v1/models", "openai_input": {}},
        {"openai_route": "/v1/models", "openai_input": None},
    ):
        result = http.post("/v2/e/runsync", json={"input": job}).json()
        assert result["status"] == "COMPLETED" and validate(result["output"][0])["data"][0]["id"] == model_name
    card = http.post("/v2/e/runsync", json={"input": {"openai_route": f"/v1/models/{model_name}"}}).json()
    assert validate(card["output"][0])["id"] == model_name
    malformed = http.post("/v2/e/runsync", json={"input": "not an object"}).json()
    assert malformed["status"] == "FAILED" and malformed["error"]["param"] == "input"


def test_run_then_stream_then_status(http, model_name) -> None:
    job = http.post("/v2/e/run", json=_chat_job(model_name, True, max_tokens=12)).json()
    assert job["status"] in ("IN_QUEUE", "IN_PROGRESS")
    pieces, status = [], None
    deadline = time.monotonic() + 120
    while status not in ("COMPLETED", "FAILED") and time.monotonic() < deadline:
        part = http.get(f"/v2/e/stream/{job['id']}").json()
        pieces += [p["output"] for p in part["stream"]]
        status = part["status"]
    assert status == "COMPLETED" and len(pieces) > 1
    final = http.get(f"/v2/e/status/{job['id']}").json()
    assert final["status"] == "COMPLETED" and final["output"] == pieces
    plain = http.post(
        "/openai/v1/chat/completions", json=_chat_job(model_name, False, max_tokens=12)["input"]["openai_input"]
    ).json()
    assert sse_text(pieces) == plain["choices"][0]["message"]["content"]


def test_cancel_stops_a_running_job(http, model_name) -> None:
    job = http.post("/run", json=_chat_job(model_name, True, max_tokens=500, extra_ignore=1, ignore_eos=True)).json()
    first = http.get(f"/stream/{job['id']}").json()
    assert first["status"] == "IN_PROGRESS"
    cancelled = http.post(f"/cancel/{job['id']}").json()
    assert cancelled["status"] == "CANCELLED"
    assert http.get(f"/status/{job['id']}").json()["status"] == "CANCELLED"
    health = http.get("/v2/e/health").json()
    assert health["jobs"]["inProgress"] == 0 and health["workers"]["idle"] == 1


def test_native_jobs(http, tokenizer) -> None:
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    whole = http.post(
        "/runsync", json={"input": {"prompt": "The capital of France is", "sampling_params": params}}
    ).json()
    assert whole["status"] == "COMPLETED"
    [output] = whole["output"]
    assert output["usage"] == {"input": len(tokenizer.encode("The capital of France is")), "output": 8}
    [text] = output["choices"][0]["tokens"]
    streamed = http.post(
        "/runsync",
        json={
            "input": {
                "prompt": "The capital of France is",
                "sampling_params": params,
                "stream": True,
                "max_batch_size": 4,
                "min_batch_size": 1,
                "batch_size_growth_factor": 2,
            }
        },
    ).json()
    sizes = [len(o["choices"][0]["tokens"]) for o in streamed["output"]]
    assert sizes == [1, 2, 4, 1] and streamed["output"][-1]["usage"]["output"] == 8
    assert "".join(t for o in streamed["output"] for t in o["choices"][0]["tokens"]) == text
    chat = http.post(
        "/runsync", json={"input": {"messages": Q, "sampling_params": {"temperature": 0, "max_tokens": 6}}}
    ).json()
    assert chat["output"][0]["choices"][0]["tokens"][0]
    two = http.post(
        "/runsync", json={"input": {"prompt": "Hi", "sampling_params": {"n": 2, "max_tokens": 3, "seed": 1}}}
    ).json()
    assert len(two["output"][0]["choices"]) == 2


def test_native_job_errors(http) -> None:
    bad = http.post("/runsync", json={"input": {"prompt": "Hi", "sampling_params": {"temprature": 0.5}}}).json()
    assert bad["status"] == "FAILED" and bad["error"]["param"] == "temprature"
    empty = http.post("/runsync", json={"input": {"stream": True}}).json()
    assert empty["status"] == "FAILED" and empty["error"]["param"] == "prompt"
    over = http.post("/runsync", json={"input": {"prompt": "hi " * 2100}}).json()
    assert over["status"] == "FAILED" and over["error"]["code"] == "context_length_exceeded"
    # Malformed chat input is a clear error naming the field, as on the OpenAI route (not an internal error).
    for content in (["hi"], 5, {"a": 1}):
        bad = http.post("/runsync", json={"input": {"messages": [{"role": "user", "content": content}]}}).json()
        assert bad["status"] == "FAILED" and bad["error"]["type"] == "invalid_request_error", bad
        assert bad["error"]["param"].startswith("messages.[0].content"), bad
    ids = http.post("/runsync", json={"input": {"prompt": [504, 3500], "apply_chat_template": True}}).json()
    assert ids["status"] == "FAILED" and ids["error"]["param"] == "prompt"


def test_custom_worker_raw_output_off_override_and_role(custom_worker) -> None:
    client = custom_worker.client()
    response = client.chat.completions.create(model="custom-name", messages=Q, max_tokens=4, temperature=0)
    assert response.model == "custom-name" and response.choices[0].message.role == "narrator"
    assert client.models.list().data[0].id == "custom-name"
    stream = list(
        client.chat.completions.create(model="custom-name", messages=Q, max_tokens=4, temperature=0, stream=True)
    )
    assert stream[0].choices[0].delta.role == "narrator"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == response.choices[0].message.content
    with custom_worker.http() as http:
        job = _chat_job("custom-name", True, max_tokens=4)
        result = http.post("/v2/e/runsync", json=job).json()
        outputs = result["output"]
        # RAW_OPENAI_OUTPUT=0: lists of chunk objects, grouped 2, 4, 4, ... by this worker's batch settings.
        assert all(isinstance(o, list) for o in outputs) and [len(o) for o in outputs][:2] == [2, 4]
        chunks = [c for o in outputs for c in o]
        assert all(c["object"] == "chat.completion.chunk" and c["model"] == "custom-name" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == response.choices[0].message.content
        assert json.dumps(chunks).count("[DONE]") == 0


def test_health_counts_every_request_by_route(http, client, model_name) -> None:
    import openai
    import pytest

    def counts() -> tuple[dict, dict]:
        health = http.get("/v2/e/health").json()
        return health["jobs"], health["jobsByRoute"]

    def added(before: dict, after: dict, route: str, status: str) -> int:
        return after.get(route, {}).get(status, 0) - before.get(route, {}).get(status, 0)

    jobs, routes = counts()
    client.chat.completions.create(model=model_name, messages=Q, max_tokens=2, temperature=0)
    list(client.chat.completions.create(model=model_name, messages=Q, max_tokens=2, temperature=0, stream=True))
    client.models.retrieve(model_name)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=Q, max_tokens=-1)
    assert http.post("/runsync", json=_chat_job(model_name, False)).json()["status"] == "COMPLETED"
    assert (
        http.post("/runsync", json={"input": {"prompt": "Hi", "sampling_params": {"max_tokens": 2}}}).json()["status"]
        == "COMPLETED"
    )
    now, now_routes = counts()
    assert now["completed"] - jobs["completed"] == 5 and now["failed"] - jobs["failed"] == 1
    assert now["inProgress"] == 0 and set(now) == {"completed", "failed", "inProgress", "inQueue", "retried"}
    assert added(routes, now_routes, "/v1/chat/completions", "completed") == 3  # two through /openai/v1, one job
    assert added(routes, now_routes, "/v1/chat/completions", "failed") == 1
    assert added(routes, now_routes, "/v1/models/{model}", "completed") == 1
    assert added(routes, now_routes, "native", "completed") == 1
    assert all(c["inProgress"] == 0 for c in now_routes.values())
