"""SIGTERM on a real `handler.py --serve` mid-stream: what finishes within the grace period finishes, what
does not ends with a clear 503 error (streamed: an SSE error event then [DONE]), and the process exits.

The test waits on events (pages held, tokens streamed), not on sleeps: it measures the decode step while the
long requests run and sizes the short request so that it needs a third of the grace period at most.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from local_worker import start_worker, stop_worker
from openai_schema import parse_sse, validate
from waiting import wait_until

# Long enough to ride out a stall of the whole machine: on two cores busy with other work, a worker once
# streamed nothing for 24 s.
GRACE_S = 20
MARGIN = 3  # the short request should need GRACE_S / MARGIN at most; the long ones MARGIN * GRACE_S at least
MAX_MODEL_LEN = 8192
LONG_TOKENS = MAX_MODEL_LEN - 192  # the chat template and the question take well under 192 tokens
CHAT = "/openai/v1/chat/completions"


class Call(threading.Thread):
    """One chat request on its own thread; a streamed one records when each of its tokens arrived."""

    def __init__(self, base: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.body = base, body
        self.token_times: list[float] = []
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
                        now = time.monotonic()
                        self.token_times += [now] * len((choice.get("logprobs") or {}).get("content") or [])
            self.reply = "".join(f"{e}\n\n" for e in events)


def _pages_in_use(http: httpx.Client) -> bool:
    engine = http.get("/health").json()["engine"]
    return engine["kv_pages_free"] < engine["kv_pages"]


def test_sigterm_lets_short_requests_finish_and_fails_long_ones_clearly(baked_model_path: Path, tmp_path: Path,
                                                                        model_name: str) -> None:
    started = time.monotonic()
    worker = start_worker(baked_model_path, tmp_path / "worker.log", SHUTDOWN_GRACE_SECONDS=str(GRACE_S),
                          MAX_MODEL_LEN=str(MAX_MODEL_LEN))
    startup_s = time.monotonic() - started
    base = {"model": model_name, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "temperature": 0, "ignore_eos": True}
    long_whole = Call(worker.base, {**base, "max_tokens": LONG_TOKENS})
    long_stream = Call(worker.base, {**base, "max_tokens": LONG_TOKENS, "stream": True, "logprobs": True})
    calls = [long_whole, long_stream]
    try:
        with worker.http() as http:
            long_whole.start()
            wait_until(lambda: _pages_in_use(http), "the non-streamed long request starts")
        long_stream.start()
        wait_until(lambda: len(long_stream.token_times) >= 17, "the streamed long request decodes 17 tokens")
        # Tokens arrive in bursts, so a step is the mean over sixteen of them.
        step_s = (long_stream.token_times[16] - long_stream.token_times[0]) / 16
        assert LONG_TOKENS * step_s > MARGIN * GRACE_S, f"decode steps of {step_s:.4f} s: too fast a machine"
        short_tokens = max(4, min(32, int(GRACE_S / (MARGIN * step_s))))
        short = Call(worker.base, {**base, "max_tokens": short_tokens, "stream": True, "logprobs": True})
        calls.append(short)
        short.start()
        wait_until(lambda: short.token_times, "the short request decodes")
        sent = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        worker.process.wait(timeout=GRACE_S + startup_s)  # exiting takes no longer than starting did
        exited_after = time.monotonic() - sent
        for call in calls:
            call.join(timeout=startup_s)
    finally:
        stop_worker(worker)

    assert not any(call.is_alive() for call in calls)
    assert "SIGTERM: 3 requests running" in worker.log.read_text()  # the short one had not finished yet
    events = [validate(e) for e in parse_sse(short.reply)]
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # finished within the grace period
    assert len(short.token_times) == short_tokens and short.token_times[-1] > sent
    long_events = parse_sse(long_stream.reply)  # ends in [DONE] (parse_sse checks it)
    error = validate(long_events[-1])["error"]
    assert error["code"] == "worker_shutting_down" and "grace period" in error["message"]
    assert any(e.get("choices") for e in long_events[:-1])  # it had been streaming text
    whole = long_whole.reply
    assert whole.status_code == 503 and validate(whole.json())["error"]["code"] == "worker_shutting_down"
    assert GRACE_S <= exited_after < GRACE_S + startup_s, (exited_after, startup_s)
