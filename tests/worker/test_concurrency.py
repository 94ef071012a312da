"""Concurrent streams match their solo answers; a client that goes away mid-stream frees its KV pages."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai_schema import validate
from waiting import HANG_S, wait_until

TOPICS = [
    "cats",
    "the sea",
    "Paris",
    "rain",
    "music",
    "bread",
    "trees",
    "the moon",
    "winter",
    "coffee",
    "trains",
    "books",
    "mountains",
    "bees",
    "glass",
    "time",
]


def _messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def test_sixteen_concurrent_streams_each_match_their_solo_answer(client, model_name) -> None:
    solo = {}
    for topic in TOPICS:
        response = client.chat.completions.create(
            model=model_name, messages=_messages(topic), max_tokens=8, temperature=0
        )
        solo[topic] = response.choices[0].message.content

    def stream(topic: str) -> str:
        chunks = client.chat.completions.create(
            model=model_name, messages=_messages(topic), max_tokens=8, temperature=0, stream=True
        )
        return "".join(validate(c)["choices"][0]["delta"].get("content") or "" for c in chunks)

    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = dict(zip(TOPICS, pool.map(stream, TOPICS), strict=True))
    assert together == solo


def _free_pages(http: httpx.Client) -> tuple[int, int]:
    engine = http.get("/health").json()["engine"]
    return engine["kv_pages_free"], engine["kv_pages"]


def _engine(http: httpx.Client) -> dict:
    return http.get("/health").json()["engine"]


def _all_free(http: httpx.Client) -> bool:
    engine = _engine(http)
    return engine["kv_pages_free"] == engine["kv_pages"]


def test_a_client_that_disconnects_mid_stream_frees_its_pages(worker, http, model_name) -> None:
    free, total = _free_pages(http)
    assert free == total  # idle: every page is free (cached prefix pages count as free)
    body = {
        "model": model_name,
        "messages": _messages("everything"),
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    before = _engine(http)["tokens_run"]
    with httpx.Client(base_url=worker.base, timeout=HANG_S) as own:
        with own.stream("POST", "/openai/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(10)]
            assert any(line.startswith("data: ") for line in received)
            in_use = _free_pages(http)[0]
            assert in_use < total  # the request holds pages while it streams
        # Leaving the block closes the connection mid-stream.
    wait_until(lambda: _all_free(http), "the pages of a stream whose client left")
    assert _engine(http)["tokens_run"] - before < 1000  # aborted, not run to its end
    assert http.get("/health").json()["jobs"]["inProgress"] == 0


def test_a_client_that_leaves_before_a_non_streamed_answer_frees_its_pages(worker, http, model_name) -> None:
    free, total = _free_pages(http)
    assert free == total
    # Long enough (about 2000 tokens) that it could only free its pages this soon by being aborted.
    body = {
        "model": model_name,
        "messages": _messages("everything"),
        "max_tokens": 1900,
        "temperature": 0,
        "ignore_eos": True,
    }
    before = _engine(http)["tokens_run"]
    payload = json.dumps(body).encode()
    host, port = worker.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:  # a client that sends a request, then leaves
        head = (
            f"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {worker.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        client.sendall(head.encode() + payload)
        wait_until(lambda: _free_pages(http)[0] < total, "the request to start")
    wait_until(lambda: _all_free(http), "the pages of a request whose client left")
    assert _engine(http)["tokens_run"] - before < 1900  # aborted, not run to its end
    assert http.get("/health").json()["jobs"]["inProgress"] == 0
