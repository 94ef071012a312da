"""SIGTERM on a real `handler.py --serve` mid-stream: what finishes within the grace period finishes, what
does not ends with a clear 503 error (streamed: an SSE error event then [DONE]), and the process exits.

Nothing here depends on how fast the machine decodes. Each side is tested where the grace period settles it: with
a grace period no request could miss (HANG_S), a request running at SIGTERM finishes whole and the process exits
once it has; with none (0 s), every request running at SIGTERM ends with the error at once. The tests wait on
events (tokens streamed, the process's exit), never on a measured speed.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path

import httpx
from local_worker import LocalWorker, start_worker, stop_worker
from openai_schema import parse_sse, validate
from waiting import HANG_S, wait_until

MAX_MODEL_LEN = 8192
LONG_TOKENS = MAX_MODEL_LEN - 192  # the chat template and the question take well under 192 tokens
# Enough decode steps that SIGTERM, sent after the first tokens, finds the request running on any machine.
DRAINED_TOKENS = 512
CHAT = "/openai/v1/chat/completions"


class Call(threading.Thread):
    """One chat request on its own thread; a streamed one counts the tokens that arrived, and when."""

    def __init__(self, base: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.body = base, body
        self.tokens = 0
        self.tokens_after_sigterm = 0
        self.sigterm_sent = threading.Event()
        self.reply: httpx.Response | str | None = None

    def run(self) -> None:
        # No client timeout: the test bounds every wait itself, and stop_worker ends the connection.
        with httpx.Client(base_url=self.base, timeout=None) as http:
            if not self.body.get("stream"):
                self.reply = http.post(CHAT, json=self.body)
                return
            events = []
            with http.stream("POST", CHAT, json=self.body) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line)
                    data = line.removeprefix("data: ")
                    choices = json.loads(data).get("choices") if data != "[DONE]" else None
                    for choice in choices or []:
                        arrived = len((choice.get("logprobs") or {}).get("content") or [])
                        self.tokens += arrived
                        if self.sigterm_sent.is_set():
                            self.tokens_after_sigterm += arrived
            self.reply = "".join(f"{e}\n\n" for e in events)


def _pages_in_use(http: httpx.Client) -> bool:
    engine = http.get("/health").json()["engine"]
    return engine["kv_pages_free"] < engine["kv_pages"]


def _sigterm(worker: LocalWorker, calls: list[Call]) -> None:
    """SIGTERM, then wait (on events) for the process to exit and every call to end."""
    for call in calls:
        call.sigterm_sent.set()
    worker.process.send_signal(signal.SIGTERM)
    worker.process.wait(timeout=HANG_S)
    for call in calls:
        call.join(timeout=HANG_S)
    assert not any(call.is_alive() for call in calls)


def test_sigterm_lets_a_running_request_finish_then_exits(
    baked_model_path: Path, tmp_path: Path, model_name: str
) -> None:
    worker = start_worker(baked_model_path, tmp_path / "worker.log", SHUTDOWN_GRACE_SECONDS=str(HANG_S))
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": DRAINED_TOKENS,
        "stream": True,
        "logprobs": True,
    }
    drained = Call(worker.base, body)
    try:
        drained.start()
        wait_until(lambda: drained.tokens, "the request decodes")
        _sigterm(worker, [drained])
    finally:
        stop_worker(worker)

    log = worker.log.read_text()
    assert "SIGTERM: 1 requests running" in log  # it was still running when the signal came
    # The drain may not get to log its end: uvicorn's own shutdown can close the loop once the stream is done.
    assert not re.search(r"grace period over: [1-9]\d* requests ended with an error", log)
    events = [validate(e) for e in parse_sse(drained.reply)]  # ends in [DONE] (parse_sse checks it)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert drained.tokens == DRAINED_TOKENS and drained.tokens_after_sigterm > 0
    assert worker.process.returncode is not None


def test_sigterm_fails_what_outlives_the_grace_period_clearly(
    baked_model_path: Path, tmp_path: Path, model_name: str
) -> None:
    worker = start_worker(
        baked_model_path, tmp_path / "worker.log", SHUTDOWN_GRACE_SECONDS="0", MAX_MODEL_LEN=str(MAX_MODEL_LEN)
    )
    base = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": LONG_TOKENS,
    }
    long_whole = Call(worker.base, base)
    long_stream = Call(worker.base, {**base, "stream": True, "logprobs": True})
    try:
        with worker.http() as http:
            long_whole.start()
            wait_until(lambda: _pages_in_use(http), "the non-streamed request starts")
        long_stream.start()
        wait_until(lambda: long_stream.tokens, "the streamed request decodes")
        _sigterm(worker, [long_whole, long_stream])
    finally:
        stop_worker(worker)

    log = worker.log.read_text()
    assert "SIGTERM: 2 requests running" in log and "grace period over: 2 requests ended with an error" in log
    long_events = parse_sse(long_stream.reply)  # ends in [DONE] (parse_sse checks it)
    error = validate(long_events[-1])["error"]
    assert error["code"] == "worker_shutting_down" and "grace period" in error["message"]
    assert any(e.get("choices") for e in long_events[:-1])  # it had been streaming text
    whole = long_whole.reply
    assert whole.status_code == 503 and validate(whole.json())["error"]["code"] == "worker_shutting_down"
