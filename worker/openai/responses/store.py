"""The bounded in-memory store behind `store`, `previous_response_id` and GET/DELETE /v1/responses/{id}.

It lives in one worker process: an endpoint with several workers cannot rely on a response stored by another;
RESPONSE_STORE_URL puts the store in Redis instead (redis_store.py), shared by all of them. Capped in entries and bytes;
the oldest entries go first. Each entry keeps the conversation up to and including its output, so a continuation needs
only that entry, not its ancestors.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # this response's own input, as GET .../input_items lists it
    context: list[dict[str, Any]]  # the whole conversation: earlier turns, this input, this output
    size: int = 0


class ResponseStore:
    """Responses by id, oldest dropped first beyond `max_entries` or `max_bytes` (JSON size)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # requests are prepared on worker threads

    def __len__(self) -> int:
        return len(self._entries)

    def check(self) -> None:
        """Always ready (the Redis store asks its server here)."""

    def put(self, entry: StoredResponse) -> None:
        entry.size = len(json.dumps([entry.response, entry.input_items, entry.context]))
        if entry.size > self.max_bytes:
            return  # larger than the whole store: keeping it would evict everything else
        with self._lock:
            self._drop(entry.response["id"])
            self._entries[entry.response["id"]] = entry
            self.bytes += entry.size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored input or output item by its id (for `item_reference` inputs), newest responses first."""
        with self._lock:
            entries = list(reversed(self._entries.values()))
        for entry in entries:
            for item in (*entry.input_items, *entry.response["output"]):
                if item.get("id") == item_id:
                    return item
        return None

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None
