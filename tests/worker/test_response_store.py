"""The bounded response store, in memory and in Redis (a real redis-server) alike: oldest first out, by entries
and by bytes; items found by id; in Redis every entry with its time to live, and the counts right after deletes."""

from __future__ import annotations

import pytest
from redis_server import redis_server

from worker.openai.responses.redis_store import RedisResponseStore
from worker.openai.responses.store import ResponseStore, StoredResponse

TTL_S = 3600


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
def make_store(request):
    """make_store(max_entries, max_bytes): an empty store of the kind the test runs on."""
    if request.param == "memory":
        return ResponseStore
    url = request.getfixturevalue("redis_url")
    prefixes = iter(range(1000))

    def redis_store(max_entries: int, max_bytes: int) -> RedisResponseStore:
        return RedisResponseStore(
            url=url,
            max_entries=max_entries,
            max_bytes=max_bytes,
            ttl_s=TTL_S,
            prefix=f"{request.node.name}:{next(prefixes)}:",
        )

    return redis_store


def _entry(i: int, text: str = "x") -> StoredResponse:
    item = {"id": f"msg_{i}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    out = {"id": f"out_{i}", "type": "message", "role": "assistant", "content": []}
    return StoredResponse({"id": f"resp_{i}", "output": [out]}, [item], [item, out])


def test_the_oldest_entries_go_first_beyond_the_entry_cap(make_store) -> None:
    store = make_store(max_entries=3, max_bytes=2**20)
    for i in range(5):
        store.put(_entry(i))
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_1") is None
    assert [store.get(f"resp_{i}").response["id"] for i in (2, 3, 4)] == ["resp_2", "resp_3", "resp_4"]


def test_the_byte_cap_evicts_and_is_accounted_exactly(make_store) -> None:
    one = _entry(0, "y" * 1000)
    store = make_store(max_entries=100, max_bytes=1)
    store.put(one)  # larger than the whole store: not kept, nothing else evicted for it
    assert len(store) == 0 and store.bytes == 0
    store = make_store(max_entries=100, max_bytes=int(one.size * 2.5))
    for i in range(4):
        store.put(_entry(i, "y" * 1000))
    assert len(store) == 2 and store.get("resp_3") is not None and store.get("resp_1") is None
    assert store.bytes == sum(store.get(f"resp_{i}").size for i in (2, 3)) <= store.max_bytes
    assert store.delete("resp_3") and not store.delete("resp_3") and store.bytes == store.get("resp_2").size


def test_items_are_found_by_id_until_their_response_goes(make_store) -> None:
    store = make_store(max_entries=1, max_bytes=2**20)
    store.put(_entry(0))
    assert store.item("msg_0")["content"][0]["text"] == "x" and store.item("out_0")["role"] == "assistant"
    store.put(_entry(1))
    assert store.item("msg_0") is None and store.item("msg_1") is not None


def test_storing_the_same_id_again_replaces_it() -> None:
    store = ResponseStore(max_entries=10, max_bytes=2**20)
    store.put(_entry(0, "a"))
    store.put(_entry(0, "bb"))
    assert len(store) == 1 and store.bytes == store.get("resp_0").size


def test_redis_entries_carry_their_time_to_live_and_a_put_again_replaces(redis_url) -> None:
    import redis

    store = RedisResponseStore(url=redis_url, max_entries=10, max_bytes=2**20, ttl_s=TTL_S, prefix="ttl:")
    store.put(_entry(0))
    store.put(_entry(0, "again"))
    assert len(store) == 1 and store.bytes == store.get("resp_0").size
    assert store.get("resp_0").input_items[0]["content"][0]["text"] == "again"
    server = redis.Redis.from_url(redis_url)
    assert 0 < server.ttl("ttl:resp:resp_0") <= TTL_S and 0 < server.ttl("ttl:item:msg_0") <= TTL_S


def test_two_clients_of_one_server_share_the_store(redis_url) -> None:
    one, two = (
        RedisResponseStore(url=redis_url, max_entries=10, max_bytes=2**20, ttl_s=TTL_S, prefix="shared:")
        for _ in range(2)
    )
    one.put(_entry(7))
    assert two.get("resp_7").context == _entry(7).context and two.item("out_7")["role"] == "assistant"
    assert two.delete("resp_7") and one.get("resp_7") is None and len(one) == 0 and one.bytes == 0
