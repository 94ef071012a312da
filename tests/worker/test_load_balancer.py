"""A load-balancing worker started as RunPod starts one: the image's own command (`python handler.py`) with PORT and
PORT_HEALTH set and no job URL. /ping answers 204 while the model loads and 200 once it serves, on its own port; the
OpenAI SDK streams a chat from /v1 meanwhile; a request past the worker's concurrency gets a 429 with Retry-After at
once; the API key rule holds for every route but /ping; SIGTERM ends the process cleanly; a model that cannot be
served makes the process exit 2, as a queue worker's does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from local_worker import ROOT, free_port, worker_env

KEY = "lb-secret"


@dataclass
class LoadBalancer:
    process: subprocess.Popen
    port: int
    health_port: int
    log: Path
    pings: list[int]  # every /ping status seen until the first 200

    def url(self, path: str, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or self.port}{path}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


def start_load_balancer(model_path: Path, log: Path, **env: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "handler.py")],
            cwd=ROOT,
            env=worker_env(model_path, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def watch_pings(process: subprocess.Popen, url: str, log: Path) -> list[int]:
    """Every answer of /ping until the first 200 (refused connections before the port is bound are not answers)."""
    seen: list[int] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not seen or seen[-1] != 200):
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            seen.append(httpx.get(url, timeout=5).status_code)
        except httpx.TransportError:
            time.sleep(0.05)  # not bound yet
    return seen


@pytest.fixture(scope="module")
def balancer(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadBalancer]:
    port, health_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("load-balancer") / "worker.log"
    env = dict(PORT=str(port), PORT_HEALTH=str(health_port), RUNPOD_API_KEY=KEY, MAX_CONCURRENCY="1")
    process = start_load_balancer(baked_model_path, log, **env)
    try:
        pings = watch_pings(process, f"http://127.0.0.1:{health_port}/ping", log)
        yield LoadBalancer(process, port, health_port, log, pings)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ping_answers_204_while_the_model_loads_then_200(balancer: LoadBalancer) -> None:
    assert balancer.pings[-1] == 200
    assert balancer.pings[0] == 204 and set(balancer.pings[:-1]) == {204}, balancer.pings
    assert httpx.get(balancer.url("/ping")).status_code == 200  # the main port answers it too
    # The health port serves nothing else.
    assert httpx.get(balancer.url("/v1/models", balancer.health_port)).status_code == 404


def test_the_openai_sdk_streams_a_chat_from_v1_while_ping_stays_200(balancer: LoadBalancer) -> None:
    client = balancer.client()
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a colour."}]
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0, stream=True)
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            assert httpx.get(balancer.url("/ping", balancer.health_port)).status_code == 200
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
    assert "".join(pieces) == whole.choices[0].message.content
    # RunPod's queue-endpoint layout answers too.
    legacy = openai.OpenAI(base_url=balancer.url("/openai/v1"), api_key=KEY, max_retries=0)
    assert legacy.models.list().data[0].id == name


def test_a_request_past_the_concurrency_is_refused_at_once_with_retry_after(balancer: LoadBalancer) -> None:
    client = balancer.client()
    name = client.models.list().data[0].id
    long = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Count."}],
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(long)
    next(chunks)  # the first request holds the worker's one slot (MAX_CONCURRENCY=1) while it streams
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "worker_busy"
    long.close()
    wait_idle(balancer)


def wait_idle(balancer: LoadBalancer) -> None:
    """Until the worker has seen the closed stream's client go and freed its slot (its /health counts)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + 60
    while httpx.get(balancer.url("/health"), headers=headers).json()["jobs"]["inProgress"]:
        assert time.monotonic() < deadline, "the closed stream still holds its slot"
        time.sleep(0.05)


def test_every_route_but_ping_needs_the_key(balancer: LoadBalancer) -> None:
    assert httpx.get(balancer.url("/v1/models")).status_code == 401
    assert httpx.get(balancer.url("/v1/models"), headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(balancer.url("/ping")).status_code == 200


def test_sigterm_ends_the_worker_cleanly(balancer: LoadBalancer) -> None:
    balancer.process.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal it caught once it has shut down: the process ends by SIGTERM, after the drain.
    assert balancer.process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert "grace period over: 0 requests ended with an error" in balancer.log.read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(balancer.url("/ping", balancer.health_port), timeout=5)


def test_a_model_that_cannot_be_served_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "model"
    empty.mkdir()
    log = tmp_path / "worker.log"
    process = start_load_balancer(empty, log, PORT=str(free_port()))
    assert process.wait(timeout=300) == 2
    assert "error:" in log.read_text()
