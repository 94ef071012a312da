"""A worker started with SPECULATIVE_CONFIG (n-gram, EAGLE-3, and MTP on a hybrid model that ships its head) answers
through the official SDK exactly as one without it (greedy, chat and completions, streamed and not), says so in its
start-up line, and reports acceptance in /health."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_worker import LocalWorker, start_worker, stop_worker

TEXT = (
    "Our team will meet on Friday at ten in the small room to plan the launch, review the budget and agree who "
    "writes the press note."
)
CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def spec_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    w = start_worker(
        baked_model_path, tmp_path_factory.mktemp("spec") / "worker.log", SPECULATIVE_CONFIG=json.dumps(CONFIG)
    )
    yield w
    stop_worker(w)


def _chat(client, model: str, stream: bool) -> str:
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n{TEXT}"}]
    if not stream:
        return (
            client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
            .choices[0]
            .message.content
        )
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_speculative_worker_answers_as_the_plain_one(spec_worker, worker, model_name) -> None:
    assert "speculative=ngram(k=4" in spec_worker.log.read_text()
    spec, plain = spec_worker.client(), worker.client()
    want = _chat(plain, model_name, stream=False)
    assert _chat(spec, model_name, stream=False) == want
    assert _chat(spec, model_name, stream=True) == want
    prompt = f"Text: {TEXT}\nThe same text again: {TEXT[:40]}"
    completion = {"model": model_name, "prompt": prompt, "max_tokens": 32, "temperature": 0}
    assert (
        spec.completions.create(**completion).choices[0].text == plain.completions.create(**completion).choices[0].text
    )
    with spec_worker.http() as http:
        engine = http.get("/v2/test-endpoint/health").json()["engine"]
    assert engine["spec_accepted_tokens"] > 0 and 0 < engine["spec_acceptance_rate"] <= 1
    assert engine["speculative"]["method"] == "ngram"


@pytest.fixture(scope="module")
def eagle_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    from tests.engine.core.eagle3_heads import write_head

    root = tmp_path_factory.mktemp("eagle3")
    write_head(root / "head", json.loads((baked_model_path / "config.json").read_text()))
    config = {"method": "eagle3", "model": str(root / "head"), "num_speculative_tokens": 3}
    w = start_worker(baked_model_path, root / "worker.log", SPECULATIVE_CONFIG=json.dumps(config))
    yield w
    stop_worker(w)


def test_an_eagle3_worker_answers_as_the_plain_one(eagle_worker, worker, model_name) -> None:
    assert "speculative=eagle3(k=3" in eagle_worker.log.read_text()
    spec, plain = eagle_worker.client(), worker.client()
    want = _chat(plain, model_name, stream=False)
    assert _chat(spec, model_name, stream=False) == want
    assert _chat(spec, model_name, stream=True) == want
    with eagle_worker.http() as http:
        engine = http.get("/v2/test-endpoint/health").json()["engine"]
    assert engine["spec_verify_steps"] > 0 and engine["speculative"]["method"] == "eagle3"


@pytest.fixture(scope="module")
def hybrid_workers(
    baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalWorker, LocalWorker]]:
    """A tiny Qwen3.5 hybrid that ships an MTP head (random mtp.* tensors), served without and with method mtp."""
    from tests.engine.core.hybrid_spec import hybrid_target

    root = tmp_path_factory.mktemp("mtp")
    # The tokenizer's whole vocabulary, so that any text is a prompt.
    folder = hybrid_target("qwen3_5_text", root / "model", baked_model_path, mtp=True, vocab_size=49152)
    shutil.copy(baked_model_path / "chat_template.jinja", folder / "chat_template.jinja")
    config = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}
    plain = start_worker(folder, root / "plain.log", MAX_MODEL_LEN="256")
    try:
        mtp = start_worker(folder, root / "mtp.log", MAX_MODEL_LEN="256", SPECULATIVE_CONFIG=json.dumps(config))
    except BaseException:
        stop_worker(plain)
        raise
    yield plain, mtp
    stop_worker(mtp)
    stop_worker(plain)


def test_an_mtp_worker_answers_as_the_plain_one(hybrid_workers) -> None:
    plain_worker, mtp_worker = hybrid_workers
    assert "speculative=mtp(k=2" in mtp_worker.log.read_text()
    spec, plain = mtp_worker.client(), plain_worker.client()
    name = plain.models.list().data[0].id
    want = _chat(plain, name, stream=False)
    assert want and _chat(spec, name, stream=False) == want
    assert _chat(spec, name, stream=True) == want
    completion = {"model": name, "prompt": f"Text: {TEXT}", "max_tokens": 24, "temperature": 0}
    assert (
        spec.completions.create(**completion).choices[0].text == plain.completions.create(**completion).choices[0].text
    )
    with mtp_worker.http() as http:
        engine = http.get("/v2/test-endpoint/health").json()["engine"]
    assert engine["spec_verify_steps"] > 0 and engine["speculative"]["method"] == "mtp"
