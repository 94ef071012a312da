"""A request body over the size limit is refused with a 413 OpenAI error before it is read whole."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

from openai_schema import validate
from waiting import wait_until


def _raw(base: str, head: bytes, chunks: list[bytes]) -> bytes:
    """Send `head` then `chunks` on one connection (stopping when the server hangs up); its answer."""
    url = urlparse(base)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:
            pass  # refused midway: the server closed its side, which is the point
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer


def _error(answer: bytes) -> dict:
    status = answer.split(b"\r\n", 1)[0]
    assert b" 413 " in status, answer[:300]
    return validate(json.loads(answer.split(b"\r\n\r\n", 1)[1]))["error"]


def test_a_declared_size_over_the_limit_is_refused_without_reading(worker) -> None:
    head = (
        b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000\r\n\r\n"
    )
    # 1 GB announced, 1 byte sent: a server that read the body first would never answer (recv times out)
    answer = _raw(worker.base, head, [b"{"])
    assert _error(answer)["code"] == "request_too_large"


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(worker, client, model_name) -> None:
    head = (
        b"POST /openai/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"a" * 2**20
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    answer = _raw(worker.base, head, [chunk] * 40)  # 40 MiB against the 20 MiB default
    assert _error(answer)["code"] == "request_too_large"
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_jobs_beyond_max_concurrency_wait_their_turn_and_all_finish(baked_model_path, tmp_path, model_name) -> None:
    from local_worker import start_worker, stop_worker

    worker = start_worker(baked_model_path, tmp_path / "worker.log", MAX_CONCURRENCY="2")
    try:
        with worker.http() as http:
            body = {"model": model_name, "prompt": "The sea is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            ids = [
                http.post("/run", json={"input": {"openai_route": "/v1/completions", "openai_input": body}}).json()[
                    "id"
                ]
                for _ in range(5)
            ]
            # The first two take their slots at once; each needs 24 decode steps, so none has finished yet.
            health = wait_until(
                lambda: (h := http.get("/health").json()["jobs"])["inProgress"] == 2 and h, "two jobs start"
            )
            assert health["inQueue"] == 3, health

            def statuses() -> list[dict] | None:
                results = [http.post(f"/status/{i}").json() for i in ids]
                return results if all(r["status"] in ("COMPLETED", "FAILED") for r in results) else None

            results = wait_until(statuses, "every job ends")
            texts = {r["output"][0]["choices"][0]["text"] for r in results}
            assert all(r["status"] == "COMPLETED" for r in results) and len(texts) == 1
            # OpenAI routes wait for a slot the same way instead of being refused.
            answer = http.post("/openai/v1/completions", json=body).json()
            assert answer["choices"][0]["text"] in texts
    finally:
        stop_worker(worker)
