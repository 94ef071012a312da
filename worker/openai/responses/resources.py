"""GET and DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items, over the response store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from worker.openai.errors import BadRequest, ResponseNotFound, RouteNotFound
from worker.openai.responses.store import ResponseStore, StoredResponse

if TYPE_CHECKING:
    from worker.openai.responses.redis_store import RedisResponseStore


class InputItemsQuery(BaseModel):
    """The query of GET .../input_items (cursor pagination as OpenAI's lists do)."""

    model_config = ConfigDict(extra="allow")

    limit: int = Field(20, ge=1, le=100)
    order: str = Field("desc", pattern="^(asc|desc)$")
    after: str | None = None


def _stored(store: ResponseStore | RedisResponseStore, response_id: str) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


def _not_found(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(
        f"No response found with id '{response_id}' on this worker (responses are stored "
        "only with store=true, in the memory of the worker that made them).",
        param="response_id",
    )


def stored_response(
    store: ResponseStore | RedisResponseStore, path: str, method: str, query: dict[str, Any]
) -> dict[str, Any]:
    """`path` is what follows /v1/responses/: `<id>` or `<id>/input_items`."""
    response_id, _, rest = path.partition("/")
    if rest == "input_items" and method == "GET":
        return input_items_page(_stored(store, response_id), InputItemsQuery.model_validate(query))
    if rest:
        raise RouteNotFound(f"Unknown route {method} /v1/responses/{path}", param="openai_route")
    if method == "DELETE":
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
    if method != "GET":
        raise BadRequest(f"{method} is not allowed on /v1/responses/{{id}}; use GET or DELETE", param="openai_method")
    return _stored(store, response_id).response


def input_items_page(entry: StoredResponse, query: InputItemsQuery) -> dict[str, Any]:
    items = entry.input_items if query.order == "asc" else entry.input_items[::-1]
    if query.after is not None:
        ids = [item["id"] for item in items]
        if query.after not in ids:
            raise BadRequest(f"after: no input item {query.after!r} in this response", param="after")
        items = items[ids.index(query.after) + 1 :]
    page = items[: query.limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
