"""Every job in .runpod/tests.json (what the RunPod Hub runs against a release) completes through the local
endpoint's /v2/<id>/runsync, the production handler behind it, with the output its route promises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from builder.sources import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]
TESTS = json.loads((ROOT / ".runpod" / "tests.json").read_text())["tests"]


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def check_native(job: dict, outputs: list[Any], served: str) -> None:
    text = "".join(tok for out in outputs for tok in out["choices"][0]["tokens"])
    assert text.strip(), "no text"
    usage = outputs[-1]["usage"]
    assert usage["input"] > 0 and 0 < usage["output"] <= job["sampling_params"]["max_tokens"]


def check_chat(job: dict, outputs: list[Any], served: str) -> None:
    body = job["openai_input"]
    if not body.get("stream"):
        (reply,) = outputs
        assert reply["object"] == "chat.completion" and reply["model"] == served
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["choices"][0]["message"]["content"].strip()
        assert 0 < reply["usage"]["completion_tokens"] <= body["max_tokens"]
        return
    assert all(isinstance(out, str) for out in outputs), "RAW_OPENAI_OUTPUT=1 streams SSE text"
    events = sse_events("".join(outputs))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    content = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert content.strip()
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0, "include_usage chunk"


def check_completion(job: dict, outputs: list[Any], served: str) -> None:
    (reply,) = outputs
    assert reply["object"] == "text_completion" and reply["model"] == served
    assert reply["choices"][0]["text"].strip()
    assert 0 < reply["usage"]["completion_tokens"] <= job["openai_input"]["max_tokens"]


def check_models(job: dict, outputs: list[Any], served: str) -> None:
    (reply,) = outputs
    assert reply["object"] == "list" and [m["id"] for m in reply["data"]] == [served]


CHECKS = {
    None: check_native,
    "/v1/chat/completions": check_chat,
    "/v1/completions": check_completion,
    "/v1/models": check_models,
}


def test_tests_json_calls_the_model_a_default_build_serves() -> None:
    """The Hub builds the Dockerfile with its default build args: the bundled default model."""
    for test in TESTS:
        model = test["input"].get("openai_input", {}).get("model")
        assert model in (None, DEFAULT_MODEL_NAME), test["name"]


@pytest.mark.parametrize("test", TESTS, ids=[t["name"] for t in TESTS])
def test_hub_test_job_completes_through_the_handler(test: dict, local_endpoint: Any) -> None:
    with local_endpoint.client() as client:
        response = client.post("/v2/hub-test/runsync", json={"input": test["input"]})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["status"] == "COMPLETED", result
    outputs = result["output"]
    assert outputs and not any(isinstance(o, dict) and o.get("error") for o in outputs), outputs
    CHECKS[test["input"].get("openai_route")](test["input"], outputs, local_endpoint.served_model_name)
