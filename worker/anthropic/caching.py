"""Prompt caching as Anthropic reports it: `usage`'s cache fields follow the request's `cache_control`.

Anthropic caches a prompt only when the request asks: `cache_control` on a block (an explicit breakpoint: the
prefix through that block) or at the top level (automatic caching: the breakpoint at the last cacheable block).
A request without it reports no cache reads or writes, so here too: its whole prompt is `input_tokens`, although
the engine's prefix cache may have spared its prefill. With `cache_control` anywhere, the worker reports its
prefix cache as Anthropic's automatic caching would: `cache_read_input_tokens` are the prompt tokens the cache
held, `cache_creation_input_tokens` the ones this request wrote to it (the rest of the prompt's whole KV pages:
the engine caches pages, not blocks, and caches every whole page whatever the breakpoints) and `input_tokens` the
tail that fills no page. The three add up to the prompt, as Anthropic's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.openai.errors import BadRequest

TTLS = ("5m", "1h")


@dataclass(frozen=True)
class Caching:
    """The request asked for caching; `ttl` is the longest its breakpoints asked for."""

    ttl: str


def requested_caching(body: dict[str, Any]) -> Caching | None:
    """The request's caching, from every `cache_control` it carries (each checked), or None without any."""
    found = [_checked(body["cache_control"], "cache_control")] if body.get("cache_control") is not None else []
    for name in ("system", "tools", "messages"):
        found += _breakpoints(body.get(name), name)
    if not found:
        return None
    return Caching("1h" if "1h" in found else "5m")


def _breakpoints(value: Any, where: str) -> list[str]:
    """The TTL of each `cache_control` in a list of blocks (tools, messages and their content blocks)."""
    if not isinstance(value, list):
        return []
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            continue  # the conversation's own checks name a malformed block
        if item.get("cache_control") is not None:
            out.append(_checked(item["cache_control"], f"{where}.{i}.cache_control"))
        out += _breakpoints(item.get("content"), f"{where}.{i}.content")
    return out


def _checked(control: Any, where: str) -> str:
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise BadRequest(f'{where}: must be {{"type": "ephemeral"}} (with an optional ttl)', param=where)
    unknown = set(control) - {"type", "ttl"}
    if unknown:
        raise BadRequest(f"{where}.{sorted(unknown)[0]}: Extra inputs are not permitted", param=where)
    ttl = control.get("ttl", "5m")
    if ttl not in TTLS:
        raise BadRequest(f"{where}.ttl: must be '5m' or '1h', got {ttl!r}", param=f"{where}.ttl")
    return ttl


def message_usage(
    caching: Caching | None,
    prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    thinking_tokens: int | None,
    page_size: int,
) -> dict[str, Any]:
    """The message's `usage`, every field Anthropic's schema requires (no server tools run: their counts are 0)."""
    read = written = 0
    if caching is not None:
        read = min(cached_tokens, prompt_tokens)
        written = max(0, prompt_tokens // page_size * page_size - read)
    return {
        "input_tokens": prompt_tokens - read - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": written if caching and caching.ttl == "5m" else 0,
            "ephemeral_1h_input_tokens": written if caching and caching.ttl == "1h" else 0,
        },
        "output_tokens": output_tokens,
        "output_tokens_details": None if thinking_tokens is None else {"thinking_tokens": thinking_tokens},
        "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
        "service_tier": "standard",
        "inference_geo": None,
    }


# The fields a message_delta event's usage has (Anthropic's MessageDeltaUsage): no TTL breakdown, tier or region.
DELTA_FIELDS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
    "output_tokens_details",
    "server_tool_use",
)


def delta_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The final usage as a message_delta event carries it."""
    return {key: usage[key] for key in DELTA_FIELDS}
