"""The bounded response store: oldest first out, by entries and by bytes; items found by id."""

from __future__ import annotations

from worker.openai.responses.store import ResponseStore, StoredResponse


def _entry(i: int, text: str = "x") -> StoredResponse:
    item = {"id": f"msg_{i}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    out = {"id": f"out_{i}", "type": "message", "role": "assistant", "content": []}
    return StoredResponse({"id": f"resp_{i}", "output": [out]}, [item], [item, out])


def test_the_oldest_entries_go_first_beyond_the_entry_cap() -> None:
    store = ResponseStore(max_entries=3, max_bytes=2**20)
    for i in range(5):
        store.put(_entry(i))
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_1") is None
    assert [store.get(f"resp_{i}").response["id"] for i in (2, 3, 4)] == ["resp_2", "resp_3", "resp_4"]


def test_the_byte_cap_evicts_and_is_accounted_exactly() -> None:
    one = _entry(0, "y" * 1000)
    store = ResponseStore(max_entries=100, max_bytes=1)
    store.put(one)  # larger than the whole store: not kept, nothing else evicted for it
    assert len(store) == 0 and store.bytes == 0
    store = ResponseStore(max_entries=100, max_bytes=int(one.size * 2.5))
    for i in range(4):
        store.put(_entry(i, "y" * 1000))
    assert len(store) == 2 and store.get("resp_3") is not None and store.get("resp_1") is None
    assert store.bytes == sum(store.get(f"resp_{i}").size for i in (2, 3)) <= store.max_bytes
    assert store.delete("resp_3") and not store.delete("resp_3") and store.bytes == store.get("resp_2").size


def test_items_are_found_by_id_until_their_response_goes() -> None:
    store = ResponseStore(max_entries=1, max_bytes=2**20)
    store.put(_entry(0))
    assert store.item("msg_0")["content"][0]["text"] == "x" and store.item("out_0")["role"] == "assistant"
    store.put(_entry(1))
    assert store.item("msg_0") is None and store.item("msg_1") is not None


def test_storing_the_same_id_again_replaces_it() -> None:
    store = ResponseStore(max_entries=10, max_bytes=2**20)
    store.put(_entry(0, "a"))
    store.put(_entry(0, "bb"))
    assert len(store) == 1 and store.bytes == store.get("resp_0").size
