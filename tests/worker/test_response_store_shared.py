"""RESPONSE_STORE_URL through the official client: two local workers on one redis-server share their responses (one
stores, the other continues it with previous_response_id, reads and deletes it), and a worker whose Redis is down
answers requests that store or continue with a 503 naming the store, while it serves every other request."""

from __future__ import annotations

import openai
import pytest
from local_worker import free_port, start_worker, stop_worker
from redis_server import redis_or_skip, redis_server


@pytest.fixture(scope="module")
def two_workers(baked_model_path, tmp_path_factory):
    with redis_server() as url:
        workers = [
            start_worker(baked_model_path, tmp_path_factory.mktemp(f"w{i}") / "worker.log", RESPONSE_STORE_URL=url)
            for i in range(2)
        ]
        try:
            yield workers
        finally:
            for w in workers:
                stop_worker(w)


@pytest.fixture(scope="module")
def worker_without_redis(baked_model_path, tmp_path_factory):
    redis_or_skip()
    w = start_worker(
        baked_model_path,
        tmp_path_factory.mktemp("down") / "worker.log",
        RESPONSE_STORE_URL=f"redis://127.0.0.1:{free_port()}/0",
    )  # nothing listens there
    yield w
    stop_worker(w)


def test_a_response_stored_by_one_worker_is_continued_through_the_other(two_workers, model_name):
    first, second = (w.client() for w in two_workers)
    one = first.responses.create(model=model_name, input="Name a colour.", max_output_tokens=8, temperature=0)
    assert second.responses.retrieve(one.id).output_text == one.output_text
    items = second.responses.input_items.list(one.id)
    assert items.data[0].content[0].text == "Name a colour."
    two = second.responses.create(
        model=model_name, input="And another one.", previous_response_id=one.id, max_output_tokens=8, temperature=0
    )
    assert two.previous_response_id == one.id and two.status in ("completed", "incomplete")
    # the second turn ran on the first turn's conversation: its prompt holds both inputs and the first answer
    assert two.usage.input_tokens > one.usage.input_tokens + one.usage.output_tokens
    assert first.responses.retrieve(two.id).id == two.id
    first.responses.delete(two.id)
    with pytest.raises(openai.NotFoundError):
        second.responses.retrieve(two.id)


def test_with_redis_down_only_requests_that_need_the_store_fail(worker_without_redis, model_name):
    client = worker_without_redis.client()
    for call in (
        lambda: client.responses.create(model=model_name, input="Hi", max_output_tokens=4),
        lambda: client.responses.create(
            model=model_name, input="Hi", max_output_tokens=4, store=False, previous_response_id="resp_missing"
        ),
        lambda: client.responses.retrieve("resp_missing"),
    ):
        with pytest.raises(openai.InternalServerError) as caught:
            call()
        assert caught.value.status_code == 503
        assert caught.value.body["code"] == "response_store_unavailable"
        assert "store: false" in caught.value.body["message"]
    answer = client.responses.create(model=model_name, input="Hi", max_output_tokens=4, store=False)
    assert answer.status in ("completed", "incomplete") and answer.output_text is not None
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None
    assert "response store at redis://127.0.0.1" in worker_without_redis.log.read_text()
