"""The `priority` request field (vLLM's) reaches the engine from every door: chat and completions (body or
extra_body), Responses and Messages (extra_body), native sampling_params; a bad value is a 400 naming it, and
SCHEDULING_POLICY is checked at start. Ordering itself: tests/engine/core/test_priority_scheduling.py.

Each door is proven by what the priority does, not by the request being accepted: on a worker whose seats are full, a
request sent through it with a high priority overtakes an earlier one. The test waits on events (the engine's
queue in /health, each stream's first output), never on a guess at how fast the machine decodes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from local_worker import LocalWorker, start_worker, stop_worker
from waiting import HANG_S, wait_until

from worker.openai.params import native_sampling_params, openai_sampling_params
from worker.openai.protocol import ChatCompletionRequest, CompletionRequest
from worker.settings import SettingsError, load_settings

# Three seats (MAX_NUM_SEQS=3) and the priority policy. A request's choices take a seat each, so a blocker of three
# choices holds them all, and a reference request of three choices and a favoured one of one cannot run together:
# whichever the scheduler takes first runs alone. (One seat would not do: the worker then holds one job at a time,
# and the others would queue in the worker, never reaching the engine's queue.)
SEATS = 3
QUEUE_MODEL_LEN = 8192
# The blocker holds the seats until the test lets it go: long enough that it cannot end while two requests queue.
BLOCKER_TOKENS = QUEUE_MODEL_LEN - 64
# Short: which queued request starts first is settled when its first output arrives; the other starts only after it
# (the two cannot run together), so its ending early cannot change the order.
QUEUED_TOKENS = 16
# Far below the default 0 so that aging (one level per 1,000 steps waited) cannot close the gap.
FAVOURED = -1000
HI = [{"role": "user", "content": "Hi"}]
DOORS = {
    "chat": ("/chat/completions", {"messages": HI, "max_tokens": QUEUED_TOKENS}),
    "completions": ("/completions", {"prompt": "Hi", "max_tokens": QUEUED_TOKENS}),
    "responses": ("/responses", {"input": "Hi", "max_output_tokens": QUEUED_TOKENS, "store": False}),
    "messages": ("/messages", {"messages": HI, "max_tokens": QUEUED_TOKENS}),
}


class Queued(threading.Thread):
    """One streamed request on its own thread. Every door sends its response headers with the request's first
    output, so their arrival marks the moment the engine started it: the thread then appends its name to
    `started`, and reads on until `release` is set, when closing the stream aborts the request."""

    def __init__(self, name: str, url: str, body: dict, started: list[str]) -> None:
        super().__init__(name=name, daemon=True)
        self.url, self.body, self.started = url, {**body, "stream": True, "ignore_eos": True}, started
        self.release, self.ended = threading.Event(), threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=HANG_S) as http, http.stream("POST", self.url, json=self.body) as reply:
                self.status = reply.status_code
                self.started.append(self.name)
                for _ in reply.iter_lines():
                    if self.release.is_set():
                        break
        finally:
            self.ended.set()


@pytest.fixture(scope="module")
def three_seat_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    w = start_worker(
        baked_model_path,
        tmp_path_factory.mktemp("three-seats") / "worker.log",
        SCHEDULING_POLICY="priority",
        MAX_NUM_SEQS=str(SEATS),
        MAX_MODEL_LEN=str(QUEUE_MODEL_LEN),
    )
    yield w
    stop_worker(w)


def _engine(http: httpx.Client) -> dict:
    return http.get("/health").json()["engine"]


def _waiting(http: httpx.Client, calls: list[Queued]) -> int:
    """How many requests wait for a seat; none of `calls` may have ended yet (a refusal, or a blocker that ran
    out of tokens, would leave the wait to its time-out)."""
    for call in calls:
        assert not call.ended.is_set(), f"the {call.name} request ended early (HTTP {call.status})"
    return _engine(http)["requests_waiting"]


def _idle(http: httpx.Client) -> bool:
    engine = _engine(http)
    return engine["requests_running"] == 0 and engine["requests_waiting"] == 0


@pytest.mark.parametrize("door", DOORS)
def test_every_door_takes_priority(three_seat_worker, model_name, door) -> None:
    """A request sent through `door` with a high priority (low number) queues behind an earlier chat request of
    the default priority and is started first; were its priority dropped, arrival order would start the other."""
    base, started = three_seat_worker.openai_url, []
    blocker = Queued(
        "blocker",
        f"{base}/chat/completions",
        {"model": model_name, "messages": HI, "max_tokens": BLOCKER_TOKENS, "n": SEATS},
        started,
    )
    reference = Queued(
        "reference", f"{base}/chat/completions", {"model": model_name, **DOORS["chat"][1], "n": SEATS}, started
    )
    path, body = DOORS[door]
    favoured = Queued(door, base + path, {"model": model_name, **body, "priority": FAVOURED}, started)
    calls = [blocker, reference, favoured]
    try:
        with three_seat_worker.http() as http:
            wait_until(lambda: _idle(http), "the worker is idle")
            blocker.start()
            wait_until(lambda: started == ["blocker"], "the blocker holds every seat")
            reference.start()
            wait_until(lambda: _waiting(http, calls[:2]) == 1, "the reference request queues")
            favoured.start()
            wait_until(lambda: _waiting(http, calls) == 2, f"the {door} request queues behind it")
            blocker.release.set()
            wait_until(lambda: len(started) > 1, "the next request starts")
            assert started[1] == door, f"{started[1]} started first: the {door} request's priority was lost"
            assert favoured.status == 200
            for call in calls:
                call.release.set()
                call.join(HANG_S)
    finally:
        for call in calls:
            call.release.set()


def test_priority_reaches_the_sampling_params() -> None:
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], priority=-3)
    assert openai_sampling_params(chat, 2048).priority == -3
    completion = CompletionRequest(model="m", prompt="Hi")
    assert openai_sampling_params(completion, 2048).priority == 0
    assert native_sampling_params({"priority": 7, "max_tokens": 2}, 2048).priority == 7


def test_scheduling_policy_is_checked_at_start() -> None:
    assert load_settings({}).scheduling_policy == "fcfs"
    assert load_settings({"SCHEDULING_POLICY": "priority"}).scheduling_policy == "priority"
    with pytest.raises(SettingsError, match="SCHEDULING_POLICY"):
        load_settings({"SCHEDULING_POLICY": "lifo"})


def test_a_bad_priority_is_a_400_naming_it(client, model_name) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"priority": "high"},
        )
    assert caught.value.body["param"] == "priority"
    assert client.models.list().data  # and the worker goes on serving
