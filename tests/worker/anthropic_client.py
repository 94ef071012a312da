"""The official `anthropic` client against a local worker, every reply it reads held to Anthropic's schema.

Test modules import `held_to_the_schema` (an autouse fixture: after each test, every reply the clients read is
checked) and `claude`, and call `create` / `stream` at temperature 0.
"""

from __future__ import annotations

import anthropic
import httpx2
import pytest
from anthropic_schema import CheckedTransport
from local_worker import ENDPOINT, LocalWorker

Q = "What is the capital of France?"
TRANSPORTS: list[CheckedTransport] = []


def sdk(worker: LocalWorker, api_key: str | None = None) -> anthropic.Anthropic:
    TRANSPORTS.append(CheckedTransport())
    return anthropic.Anthropic(
        base_url=worker.url(f"{ENDPOINT}/openai"),
        api_key=api_key or worker.api_key,
        max_retries=0,
        timeout=120,
        http_client=httpx2.Client(transport=TRANSPORTS[-1], timeout=120),
    )


@pytest.fixture(autouse=True)
def held_to_the_schema():
    """After each test, every reply the SDK read during it, checked against Anthropic's schema."""
    yield
    # NOTE: a failed check fails the test in its teardown, naming the field (SchemaError).
    for transport in TRANSPORTS:
        transport.verify()


@pytest.fixture(scope="module")
def claude(worker: LocalWorker) -> anthropic.Anthropic:
    return sdk(worker)


def create(claude: anthropic.Anthropic, model: str, **kw):
    """messages.create at temperature 0 (this SDK has no temperature argument; the API takes the field)."""
    kw.setdefault("max_tokens", 24)
    kw.setdefault("messages", [{"role": "user", "content": Q}])
    kw["extra_body"] = {"temperature": 0, **kw.get("extra_body", {})}
    return claude.messages.create(model=model, **kw)


def stream(claude: anthropic.Anthropic, model: str, **kw):
    kw["extra_body"] = {"temperature": 0, **kw.get("extra_body", {})}
    return claude.messages.stream(model=model, **kw)
