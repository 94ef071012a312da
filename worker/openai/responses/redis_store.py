"""The response store in Redis (RESPONSE_STORE_URL=redis://...), so that every worker of an endpoint continues and
reads the responses any of them stored. The same caps as the in-memory store (entries and bytes, oldest out
first; an entry larger than the whole store is not kept) and a time to live on every entry.

Keys under one prefix: `resp:{id}` the entry's JSON, `item:{id}` the id of the newest response holding that input or
output item (both with the TTL), `order` (ids by a shared counter, `seq`), `expiry` (ids by expiry time), `sizes`
(id -> bytes) and `bytes` (their sum). Dropping an entry is one Lua script, so workers evicting at once keep the
counts right. Redis unreachable: StoreUnavailable (503), raised before the request is run where it can be.
"""

from __future__ import annotations

import json
import time
from typing import Any, cast
from urllib.parse import urlsplit

from worker.openai.errors import StoreUnavailable
from worker.openai.responses.store import StoredResponse

# Seconds a client waits on Redis before the request fails with StoreUnavailable.
TIMEOUT_S = 2.0
DROP = """
local id = ARGV[1]
local size = redis.call('HGET', KEYS[1], id)
redis.call('ZREM', KEYS[3], id)
redis.call('ZREM', KEYS[4], id)
redis.call('DEL', KEYS[5] .. id)
if size then
    redis.call('HDEL', KEYS[1], id)
    redis.call('DECRBY', KEYS[2], size)
    return 1
end
return 0
"""


class RedisResponseStore:
    """ResponseStore's methods over a Redis server at `url`; entries expire `ttl_s` seconds after they are put."""

    def __init__(self, *, url: str, max_entries: int, max_bytes: int, ttl_s: int, prefix: str = "llm-worker:") -> None:
        import redis

        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._errors = redis.RedisError
        self._redis = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        parts = urlsplit(url)
        self.where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}"  # never the password
        self._keys = {name: f"{prefix}{name}" for name in ("sizes", "bytes", "order", "expiry", "seq")}
        self._resp, self._item = f"{prefix}resp:", f"{prefix}item:"
        self._drop_script = self._redis.register_script(DROP)

    def __len__(self) -> int:
        return self._call(lambda: self._redis.zcard(self._keys["order"]))

    @property
    def bytes(self) -> int:
        return int(self._call(lambda: self._redis.get(self._keys["bytes"])) or 0)

    def check(self) -> None:
        """StoreUnavailable unless Redis answers (asked before a request that will store its response is run)."""
        self._call(self._redis.ping)

    def put(self, entry: StoredResponse) -> None:
        payload = json.dumps([entry.response, entry.input_items, entry.context])
        entry.size = len(payload)
        if entry.size > self.max_bytes:
            return  # larger than the whole store: keeping it would evict everything else
        rid = entry.response["id"]

        def write() -> None:
            self._drop(rid)
            seq = self._redis.incr(self._keys["seq"])
            pipe = self._redis.pipeline()
            pipe.set(self._resp + rid, payload, ex=self.ttl_s)
            for item in (*entry.input_items, *entry.response["output"]):
                if item.get("id"):
                    pipe.set(self._item + item["id"], rid, ex=self.ttl_s)
            pipe.zadd(self._keys["order"], {rid: seq})
            pipe.zadd(self._keys["expiry"], {rid: time.time() + self.ttl_s})
            pipe.hset(self._keys["sizes"], rid, entry.size)
            pipe.incrby(self._keys["bytes"], entry.size)
            pipe.execute()
            self._evict()

        self._call(write)

    def get(self, response_id: str) -> StoredResponse | None:
        raw = self._call(lambda: self._redis.get(self._resp + response_id))
        if raw is None:
            return None
        response, input_items, context = json.loads(raw)
        return StoredResponse(response, input_items, context, size=len(raw))

    def delete(self, response_id: str) -> bool:
        return bool(self._call(lambda: self._drop(response_id)))

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored input or output item by its id, from the newest response that holds it."""
        rid = self._call(lambda: self._redis.get(self._item + item_id))
        entry = None if rid is None else self.get(rid.decode())
        if entry is None:
            return None
        return next((i for i in (*entry.input_items, *entry.response["output"]) if i.get("id") == item_id), None)

    def _evict(self) -> None:
        """Entries past their TTL, then the oldest while a cap is exceeded."""
        # NOTE: the client returns bytes (no decode_responses); redis-py types its replies far more broadly.
        for rid in cast(list[bytes], self._redis.zrangebyscore(self._keys["expiry"], "-inf", time.time())):
            self._drop(rid.decode())
        while True:
            count, total = self._redis.zcard(self._keys["order"]), int(self._redis.get(self._keys["bytes"]) or 0)
            if count <= self.max_entries and total <= self.max_bytes:
                return
            oldest = cast(list[bytes], self._redis.zrange(self._keys["order"], 0, 0))
            if not oldest:
                return
            self._drop(oldest[0].decode())

    def _drop(self, response_id: str) -> int:
        k = self._keys
        return self._drop_script(keys=[k["sizes"], k["bytes"], k["order"], k["expiry"], self._resp], args=[response_id])

    def _call(self, run):
        try:
            return run()
        except self._errors as exc:
            raise StoreUnavailable(
                f"The response store at {self.where} is unavailable ({type(exc).__name__}: {exc}); requests with "
                f"store: false are served without it."
            ) from None
