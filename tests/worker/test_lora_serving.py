"""LoRA adapters end to end: baked beside the default model by the builder, listed and called with the official
SDK through the local endpoint on every route, each giving its own answers; bad names are 404s naming `model`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from local_worker import ROOT, LocalWorker, start_worker, stop_worker
from openai_schema import validate

from engine.model.adapters import projection_shapes
from tests.lora_adapters import ALL_TARGETS, write_adapter

ADAPTERS = {
    "pirate": dict(targets=["q_proj", "v_proj"], rank=8, alpha=16.0, seed=1),
    "poet": dict(targets=ALL_TARGETS, rank=4, alpha=8.0, seed=2),
    "critic": dict(targets=["gate_proj", "up_proj", "down_proj"], rank=16, alpha=16.0, seed=3),
}
PROMPT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def base_path(baked_model_path: Path, model_name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BASE_PATH whose model is the baked default (linked, not copied) and whose adapters the builder baked."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("lora-base")
    model = root / "model"
    model.mkdir()
    for path in baked_model_path.iterdir():
        if path.is_file():
            (model / path.name).symlink_to(path.resolve())
    (model / "manifest.json").unlink()
    shutil.copy(baked_model_path / "manifest.json", model / "manifest.json")
    config = AutoConfig.from_pretrained(baked_model_path)
    modules = []
    for name, spec in ADAPTERS.items():
        write_adapter(
            root / "sources" / name,
            projection_shapes(config),
            config.num_hidden_layers,
            std=0.05,
            base_model_name_or_path=model_name,
            **spec,
        )
        modules.append({"name": name, "path": str(root / "sources" / name), "base_model_name": model_name})
    result = run_builder(model, json.dumps(modules))
    assert result.returncode == 0, result.stderr
    return root


def run_builder(out: Path, lora_modules: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORA_MODULES": lora_modules}
    return subprocess.run(
        [sys.executable, "-m", "builder", "--if-missing", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def lora_worker(base_path: Path) -> Iterator[LocalWorker]:
    w = start_worker(base_path / "model", base_path / "worker.log")
    yield w
    stop_worker(w)


@pytest.fixture(scope="module")
def sdk(lora_worker: LocalWorker) -> openai.OpenAI:
    return lora_worker.client()


def chat(sdk: openai.OpenAI, model: str, **kw) -> str:
    kw = {"messages": PROMPT, "temperature": 0, "max_tokens": 12, **kw}
    reply = sdk.chat.completions.create(model=model, **kw)
    assert reply.model == model
    return reply.choices[0].message.content


def test_the_manifest_lists_each_adapter_with_rank_targets_and_checksums(base_path: Path) -> None:
    manifest = json.loads((base_path / "model" / "manifest.json").read_text())
    entries = {a["name"]: a for a in manifest["adapters"]}
    assert list(entries) == list(ADAPTERS)
    for name, spec in ADAPTERS.items():
        assert entries[name]["rank"] == spec["rank"] and entries[name]["target_modules"] == spec["targets"]
        assert set(entries[name]["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
        source = entries[name]["source"]
        assert (source["kind"], source["ref"]) == ("local", name) and len(source["fingerprint"]) == 64
        assert (base_path / "model" / entries[name]["path"] / "adapter_model.safetensors").is_file()


def test_models_lists_the_base_and_each_adapter_with_its_parent(sdk: openai.OpenAI, model_name: str) -> None:
    cards = [m.model_dump() for m in sdk.models.list().data]
    assert [c["id"] for c in cards] == [model_name, *ADAPTERS]
    assert cards[0]["parent"] is None
    assert all(c["parent"] == model_name for c in cards[1:])
    assert sdk.models.retrieve("poet").model_dump()["parent"] == model_name
    assert sdk.models.retrieve(f"{model_name}:poet").model_dump()["parent"] == model_name


def test_each_adapter_answers_as_itself_by_either_name_streamed_or_not(sdk: openai.OpenAI, model_name: str) -> None:
    answers = {name: chat(sdk, name) for name in [model_name, *ADAPTERS]}
    assert len(set(answers.values())) == len(answers), answers  # every adapter changes the answer
    assert chat(sdk, f"{model_name}:pirate") == answers["pirate"]
    stream = sdk.chat.completions.create(model="poet", messages=PROMPT, temperature=0, max_tokens=12, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"poet"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answers["poet"]
    # Concurrent requests of every adapter and the base batch together and still answer as each does alone.
    names = [model_name, *ADAPTERS] * 2
    with ThreadPoolExecutor(len(names)) as pool:
        assert list(pool.map(lambda n: chat(sdk, n), names)) == [answers[n] for n in names]


def test_completions_responses_tools_and_structured_outputs_run_with_an_adapter(
    sdk: openai.OpenAI, model_name: str
) -> None:
    texts = {
        m: sdk.completions.create(model=m, prompt="The sky is", temperature=0, max_tokens=8).choices[0].text
        for m in (model_name, "critic")
    }
    assert texts["critic"] != texts[model_name]

    response = sdk.responses.create(model="critic", input="Name a colour.", temperature=0, max_output_tokens=12)
    assert response.model == "critic" and response.output_text == chat(sdk, "critic")

    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    reply = sdk.chat.completions.create(
        model="pirate",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_tokens=40,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)

    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    content = chat(
        sdk,
        "poet",
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert json.loads(content)["colour"] in {"red", "green", "blue"}


def test_a_native_job_takes_the_same_model_field(lora_worker: LocalWorker, sdk: openai.OpenAI) -> None:
    job = {"input": {"prompt": "The sky is", "model": "critic", "sampling_params": {"temperature": 0, "max_tokens": 8}}}
    with lora_worker.http() as http:
        result = http.post("/v2/e/runsync", json=job).json()
        assert result["status"] == "COMPLETED", result
        completion = sdk.completions.create(model="critic", prompt="The sky is", temperature=0, max_tokens=8)
        assert result["output"][0]["choices"][0]["tokens"] == [completion.choices[0].text]
        job["input"]["model"] = "nope"
        failed = http.post("/v2/e/runsync", json=job).json()
        assert failed["status"] == "FAILED" and failed["error"]["param"] == "model"


@pytest.mark.parametrize("model", ["nope", "{base}:nope", "other-base:poet"])
def test_an_unknown_adapter_is_a_404_naming_model_and_the_worker_keeps_serving(
    sdk: openai.OpenAI, model_name: str, model: str
) -> None:
    model = model.format(base=model_name)
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=4)
    error = validate(info.value.response.json())["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found" and model in error["message"]
    assert "`poet`" in error["message"]  # it says which adapters there are
    assert chat(sdk, "poet")


def test_enable_lora_off_serves_the_base_model_alone(base_path: Path, model_name: str, tmp_path: Path) -> None:
    w = start_worker(base_path / "model", tmp_path / "worker.log", ENABLE_LORA="false")
    try:
        with w.http() as http:
            models = http.get(f"{w.openai_url}/models").json()
            assert [m["id"] for m in models["data"]] == [model_name]
            body = {"model": "poet", "messages": PROMPT, "max_tokens": 4}
            assert http.post(f"{w.openai_url}/chat/completions", json=body).status_code == 404
    finally:
        stop_worker(w)


def test_bad_lora_modules_fail_the_bake_in_one_line_and_leave_the_bake_as_it_was(
    base_path: Path, model_name: str
) -> None:
    model = base_path / "model"
    before = (model / "manifest.json").read_text()
    sources = base_path / "sources"
    # Trained on a Llama of another width: the shapes say so.
    write_adapter(sources / "wide", {"q_proj": (1024, 1024)}, 2, targets=["q_proj"])
    cases = {
        f"wide={sources / 'wide'}": "another base model",
        "pirate": "is not name=path",
        "x=/no/such/folder": "does not exist",
        "bad:name=" + str(sources / "poet"): "no ':'",
        f"a={sources / 'poet'} a={sources / 'poet'}": "given twice",
        json.dumps(
            [{"name": "p", "path": str(sources / "poet"), "base_model_name": "meta-llama/Llama-3.2-1B"}]
        ): "is for base model 'meta-llama/Llama-3.2-1B'",
        json.dumps([{"name": "p", "paht": "x"}]): '"name" and "path"',
        f"{model_name}={sources / 'poet'}": "the model's own name",
        f"p={model}": "not a PEFT adapter",
    }
    for value, words in cases.items():
        result = run_builder(model, value)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and words in lines[0], (value, result.stderr)
    assert (model / "manifest.json").read_text() == before
    assert sorted(p.name for p in (model / "adapters").iterdir()) == sorted(ADAPTERS)
    assert not [p for p in model.iterdir() if p.name.startswith(".")], "staging left behind"
