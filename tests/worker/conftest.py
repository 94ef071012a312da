"""Fixtures: local workers (`handler.py --serve` subprocesses), one per session, and their clients.

`worker` runs with the default settings; `custom_worker` with RAW_OPENAI_OUTPUT=0, a served-name
override, a custom response role and an API key. Both serve the baked default model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from local_worker import LocalWorker, start_worker, stop_worker


@pytest.fixture(scope="session")
def worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    w = start_worker(
        baked_model_path, tmp_path_factory.mktemp("worker") / "worker.log", MODEL_NAME="test-org/alias-name"
    )
    yield w
    stop_worker(w)


@pytest.fixture(scope="session")
def custom_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    w = start_worker(
        baked_model_path,
        tmp_path_factory.mktemp("custom") / "worker.log",
        RAW_OPENAI_OUTPUT="0",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="custom-name",
        OPENAI_RESPONSE_ROLE="narrator",
        RUNPOD_API_KEY="test-secret",
        DEFAULT_BATCH_SIZE="4",
        DEFAULT_MIN_BATCH_SIZE="2",
        DEFAULT_BATCH_SIZE_GROWTH_FACTOR="2",
    )
    yield w
    stop_worker(w)


@pytest.fixture(scope="session")
def model_name(baked_model_path: Path) -> str:
    from worker.settings import baked_model_name

    return baked_model_name(str(baked_model_path))


@pytest.fixture(scope="session")
def client(worker: LocalWorker) -> openai.OpenAI:
    return worker.client()


@pytest.fixture(scope="session")
def http(worker: LocalWorker) -> Iterator[httpx.Client]:
    with worker.http() as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(baked_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(baked_model_path))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    """A grammar cache over the baked model's tokenizer, for the tests that match call markup against a grammar."""
    from engine.sample.structured.compiler import GrammarCache

    cache = GrammarCache(tokenizer=tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    yield cache
    cache.shutdown()
