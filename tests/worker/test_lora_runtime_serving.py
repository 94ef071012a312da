"""LoRA adapters that are not baked, through the local endpoint: LORA_MODULES read at start from a hub-cache
layout, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true),
called as vLLM's users call them, with the official SDK on the adapters they load; bad adapters are clear errors
and the worker keeps serving; off by default."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from local_worker import ENDPOINT, LocalWorker, start_worker, stop_worker

from engine.model.adapters import projection_shapes
from tests.lora_adapters import ALL_TARGETS, write_adapter

PROMPT = [{"role": "user", "content": "Name a colour."}]
V1 = f"{ENDPOINT}/openai/v1"


@pytest.fixture(scope="module")
def sources(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters for the default model: `pirate` in a hub cache's layout (org/smol-pirate at refs/main), `poet`
    and `critic` and `wide` (rank 16) in plain folders."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("lora-runtime")
    config = AutoConfig.from_pretrained(baked_model_path)
    shapes, layers = projection_shapes(config), config.num_hidden_layers
    repo = root / "cache" / "models--org--smol-pirate"
    write_adapter(
        repo / "snapshots" / "0123abcd", shapes, layers, targets=["q_proj", "v_proj"], rank=8, seed=1, std=0.05
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    write_adapter(root / "poet", shapes, layers, targets=ALL_TARGETS, rank=4, seed=2, std=0.05)
    write_adapter(
        root / "critic", shapes, layers, targets=["gate_proj", "up_proj", "down_proj"], rank=8, seed=3, std=0.05
    )
    write_adapter(root / "wide", shapes, layers, targets=["q_proj"], rank=16, seed=4)
    return root


@pytest.fixture(scope="module")
def lora_worker(baked_model_path: Path, sources: Path) -> Iterator[LocalWorker]:
    w = start_worker(
        baked_model_path,
        sources / "worker.log",
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="true",
        LORA_MODULES=json.dumps([{"name": "pirate", "path": "org/smol-pirate"}]),
        MODEL_CACHE_PATH=str(sources / "cache"),
        HF_HUB_OFFLINE="1",
        MAX_LORAS="2",
        MAX_LORA_RANK="8",
    )
    yield w
    stop_worker(w)


@pytest.fixture(scope="module")
def sdk(lora_worker: LocalWorker) -> openai.OpenAI:
    return lora_worker.client()


def chat(sdk: openai.OpenAI, model: str) -> str:
    reply = sdk.chat.completions.create(model=model, messages=PROMPT, temperature=0, max_tokens=12)
    return reply.choices[0].message.content


def post(worker: LocalWorker, route: str, body: dict) -> httpx.Response:
    with worker.http() as http:
        return http.post(f"{V1}/{route}", json=body)


def test_lora_modules_at_start_come_from_the_hub_cache(sdk: openai.OpenAI, model_name: str) -> None:
    assert [m.id for m in sdk.models.list().data] == [model_name, "pirate"]
    assert chat(sdk, "pirate") != chat(sdk, model_name)


def test_an_adapter_loaded_while_serving_is_served_then_unloaded(
    lora_worker: LocalWorker, sdk: openai.OpenAI, model_name: str, sources: Path
) -> None:
    base = chat(sdk, model_name)
    # A stream that runs while the adapter loads finishes as it would alone.
    alone = "".join(
        c.choices[0].delta.content or ""
        for c in sdk.chat.completions.create(
            model=model_name, messages=PROMPT, temperature=0, max_tokens=48, stream=True
        )
        if c.choices
    )
    streamed: list[str] = []
    first = threading.Event()

    def consume() -> None:
        for c in sdk.chat.completions.create(
            model=model_name, messages=PROMPT, temperature=0, max_tokens=48, stream=True
        ):
            streamed.append(c.choices[0].delta.content or "" if c.choices else "")
            first.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert first.wait(120)
    loaded = post(lora_worker, "load_lora_adapter", {"lora_name": "poet", "lora_path": str(sources / "poet")})
    reader.join(120)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'poet' added successfully."
    assert "".join(streamed) == alone

    assert [m.id for m in sdk.models.list().data] == [model_name, "pirate", "poet"]
    assert sdk.models.retrieve("poet").model_dump()["parent"] == model_name
    poet = chat(sdk, "poet")
    assert poet not in (base, chat(sdk, "pirate"))
    stream = sdk.chat.completions.create(model="poet", messages=PROMPT, temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == poet
    assert sdk.completions.create(model=f"{model_name}:poet", prompt="Hi", max_tokens=2).model == f"{model_name}:poet"

    # Both slots (MAX_LORAS=2) are taken now: a third is refused until one is unloaded.
    full = post(lora_worker, "load_lora_adapter", {"lora_name": "critic", "lora_path": str(sources / "critic")})
    assert full.status_code == 400 and "MAX_LORAS" in full.json()["error"]["message"]
    unloaded = post(lora_worker, "unload_lora_adapter", {"lora_name": "poet"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'poet' removed successfully."
    with pytest.raises(openai.NotFoundError) as info:
        chat(sdk, "poet")
    assert info.value.body["param"] == "model"
    assert (
        post(
            lora_worker, "load_lora_adapter", {"lora_name": "critic", "lora_path": str(sources / "critic")}
        ).status_code
        == 200
    )
    assert chat(sdk, "critic") not in (base, poet)
    assert chat(sdk, model_name) == base


def test_bad_loads_and_unloads_are_clear_errors_and_the_worker_serves_on(
    lora_worker: LocalWorker, sdk: openai.OpenAI, model_name: str, sources: Path
) -> None:
    cases = [
        ({"lora_name": "pirate", "lora_path": str(sources / "poet")}, 400, "has already been loaded"),
        ({"lora_name": "w", "lora_path": str(sources / "wide")}, 400, "MAX_LORA_RANK=8"),
        ({"lora_name": "gone", "lora_path": str(sources / "nowhere")}, 404, "No adapter found"),
        ({"lora_name": "gone", "lora_path": "org/not-cached"}, 404, "HF_HUB_OFFLINE"),
        ({"lora_name": "no path"}, 400, "'lora_path' must be provided"),
        ({"lora_name": "a:b", "lora_path": str(sources / "poet")}, 400, "no ':' or spaces"),
        ({"lora_name": "nobase", "lora_path": str(sources)}, 400, "is not a PEFT adapter"),
    ]
    for body, status, words in cases:
        reply = post(lora_worker, "load_lora_adapter", body)
        assert reply.status_code == status, (body, reply.text)
        error = reply.json()["error"]
        assert words in error["message"] and "\n" not in error["message"], (body, error)
    missing = post(lora_worker, "unload_lora_adapter", {"lora_name": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"
    assert chat(sdk, model_name)


def test_the_job_routes_take_the_same_bodies(lora_worker: LocalWorker, sources: Path) -> None:
    with lora_worker.http() as http:

        def job(route: str, body: dict) -> dict:
            reply = http.post(f"{ENDPOINT}/runsync", json={"input": {"openai_route": route, "openai_input": body}})
            return reply.json()

        unload = job("/v1/unload_lora_adapter", {"lora_name": "pirate"})
        assert unload["status"] == "COMPLETED" and "removed successfully" in json.dumps(unload["output"])
        load = job("/v1/load_lora_adapter", {"lora_name": "pirate", "lora_path": "org/smol-pirate"})
        assert load["status"] == "COMPLETED" and "added successfully" in json.dumps(load["output"])


def test_the_routes_are_off_by_default(http: httpx.Client) -> None:
    reply = http.post(f"{V1}/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"})
    assert reply.status_code == 404
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in reply.json()["error"]["message"]


def test_a_lora_module_found_nowhere_stops_the_start_in_one_line(baked_model_path: Path, sources: Path) -> None:
    with pytest.raises(RuntimeError, match="the worker exited") as info:
        start_worker(
            baked_model_path,
            sources / "missing.log",
            LORA_MODULES="sql=org/not-cached",
            MODEL_CACHE_PATH=str(sources / "cache"),
            HF_HUB_OFFLINE="1",
        )
    lines = [line for line in str(info.value).splitlines() if "LORA_MODULES" in line]
    assert lines and "No adapter found for 'sql' at 'org/not-cached'" in lines[-1], str(info.value)[-2000:]
