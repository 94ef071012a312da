"""SIGTERM on a real `handler.py --serve` mid-stream: what finishes within the grace period finishes, what
does not ends with a clear 503 error (streamed: an SSE error event then [DONE]), and the process exits."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
from local_worker import start_worker, stop_worker
from openai_schema import parse_sse, validate

GRACE_S = 3


def test_sigterm_lets_short_requests_finish_and_fails_long_ones_clearly(baked_model_path: Path, tmp_path: Path,
                                                                        model_name: str) -> None:
    worker = start_worker(baked_model_path, tmp_path / "worker.log", SHUTDOWN_GRACE_SECONDS=str(GRACE_S))
    chat = "/openai/v1/chat/completions"
    base = {"model": model_name, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "temperature": 0, "ignore_eos": True}
    results: dict[str, httpx.Response | str] = {}

    def call(name: str, body: dict) -> None:
        with httpx.Client(base_url=worker.base, timeout=120) as http:
            if body.get("stream"):
                with http.stream("POST", chat, json=body) as reply:
                    results[name] = "".join(reply.iter_text())
            else:
                results[name] = http.post(chat, json=body)

    try:
        calls = {"long_stream": {**base, "max_tokens": 1500, "stream": True},
                 "long_whole": {**base, "max_tokens": 1500},
                 "short_stream": {**base, "max_tokens": 24, "stream": True}}
        threads = [threading.Thread(target=call, args=item) for item in calls.items()]
        for thread in threads:
            thread.start()
        time.sleep(2.0)  # all three are decoding
        sent = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        worker.process.wait(timeout=GRACE_S + 20)
        exited_after = time.monotonic() - sent
    finally:
        stop_worker(worker)

    short = [validate(e) for e in parse_sse(results["short_stream"])]
    assert short[-1]["choices"][0]["finish_reason"] == "length"  # finished within the grace period
    long_events = parse_sse(results["long_stream"])  # ends in [DONE] (parse_sse checks it)
    error = validate(long_events[-1])["error"]
    assert error["code"] == "worker_shutting_down" and "grace period" in error["message"]
    assert any(e.get("choices") for e in long_events[:-1])  # it had been streaming text
    whole = results["long_whole"]
    assert whole.status_code == 503 and validate(whole.json())["error"]["code"] == "worker_shutting_down"
    assert worker.process.returncode is not None and exited_after < GRACE_S + 10
