"""Anthropic's `usage` through the official client: prompt caching reported as Anthropic reports it (nothing
without `cache_control`; reads, writes and their TTL with it), thinking tokens, and the stop sequence in the
stream's message_delta. Every reply is held to Anthropic's schema (anthropic_client.held_to_the_schema)."""

from __future__ import annotations

import uuid

import pytest
from anthropic_client import claude, create, held_to_the_schema, stream  # noqa: F401 (fixtures, used by name)
from family_templates import QWEN3
from local_worker import ENDPOINT

PAGE = 16  # BLOCK_SIZE's default: the test worker's KV page


def _long_system() -> str:
    """A system prompt of several pages, new to the prefix cache."""
    return f"Session {uuid.uuid4().hex}. " + "You answer questions about European capitals briefly. " * 12


def _ask(system, **kw) -> dict:
    return {"system": system, "max_tokens": 4, "messages": [{"role": "user", "content": "The capital of Italy?"}], **kw}


def _total(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def test_without_cache_control_nothing_is_reported_cached(claude, client, model_name) -> None:
    ask = _ask(_long_system())
    counted = claude.messages.count_tokens(model=model_name, system=ask["system"], messages=ask["messages"])
    for _ in range(2):
        made = create(claude, model_name, **ask)
        assert made.usage.input_tokens == counted.input_tokens
        assert made.usage.cache_read_input_tokens == 0 and made.usage.cache_creation_input_tokens == 0
        assert (
            made.usage.cache_creation.ephemeral_5m_input_tokens
            == made.usage.cache_creation.ephemeral_1h_input_tokens
            == 0
        )
        assert made.usage.service_tier == "standard" and made.usage.server_tool_use.web_search_requests == 0
    # The engine's prefix cache did serve the repeat: the chat route, which reports it, says so.
    chat = client.chat.completions.create(
        model=model_name, max_tokens=1, messages=[{"role": "system", "content": ask["system"]}, *ask["messages"]]
    )
    assert chat.usage.prompt_tokens_details.cached_tokens > 0


def test_automatic_caching_reads_what_the_first_request_wrote(claude, model_name) -> None:
    ask = _ask(_long_system(), extra_body={"cache_control": {"type": "ephemeral"}})
    counted = claude.messages.count_tokens(model=model_name, system=ask["system"], messages=ask["messages"])
    first = create(claude, model_name, **ask)
    assert _total(first.usage) == counted.input_tokens
    assert first.usage.cache_creation_input_tokens > PAGE  # the new system prompt's pages were written
    assert first.usage.input_tokens < PAGE  # the tail that fills no page
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == first.usage.cache_creation_input_tokens
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == 0
    again = create(claude, model_name, **ask)
    assert _total(again.usage) == counted.input_tokens
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens - PAGE
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens


def test_a_breakpoint_on_a_block_with_a_one_hour_ttl_streamed(claude, model_name) -> None:
    system = [{"type": "text", "text": _long_system(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    with stream(claude, model_name, **_ask(system)) as s:
        events = list(s)
        final = s.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    usage = final.usage
    assert usage.cache_creation.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens > 0
    assert usage.cache_creation.ephemeral_5m_input_tokens == 0
    assert start.message.usage.output_tokens == 0 and _total(start.message.usage) == _total(usage)


@pytest.mark.parametrize(
    ("where", "control", "words"),
    [
        ("top", {"type": "persistent"}, "cache_control: must be"),
        ("top", {"type": "ephemeral", "ttl": "10m"}, "cache_control.ttl"),
        ("block", {"type": "ephemeral", "scope": "global"}, "messages.0.content.0.cache_control.scope"),
    ],
)
def test_a_malformed_cache_control_is_a_400(http, model_name, where, control, words) -> None:
    block = {"type": "text", "text": "Hi", **({"cache_control": control} if where == "block" else {})}
    body = {
        "model": model_name,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [block]}],
        **({"cache_control": control} if where == "top" else {}),
    }
    for route in ("messages", "messages/count_tokens"):
        reply = http.post(f"{ENDPOINT}/openai/v1/{route}", json=body)
        assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text


THOUGHT = "<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\nParis[.]"


def test_thinking_tokens_are_counted_apart(claude, model_name) -> None:
    made = create(
        claude,
        model_name,
        max_tokens=60,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"chat_template": QWEN3, "structured_outputs": {"regex": THOUGHT}},
    )
    assert [b.type for b in made.content] == ["thinking", "text"]
    assert 0 < made.usage.output_tokens_details.thinking_tokens < made.usage.output_tokens
    plain = create(claude, model_name, max_tokens=4)
    assert plain.usage.output_tokens_details is None  # the default model's template has no reasoning format


def test_the_stream_names_the_stop_sequence(claude, model_name) -> None:
    first = create(claude, model_name, max_tokens=24)
    word = first.content[0].text.split()[2]
    with stream(
        claude,
        model_name,
        max_tokens=24,
        stop_sequences=[word],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    ) as s:
        events = list(s)
        final = s.get_final_message()
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == word
    assert final.stop_sequence == word and word not in final.content[0].text


def test_a_stream_cut_by_shutdown_ends_with_a_schema_error_event(baked_model_path, tmp_path, model_name) -> None:
    """SIGTERM with no grace mid-stream: the Messages stream's last event is Anthropic's `error` event."""
    import signal

    import httpx
    from anthropic_schema import check_stream, sse_events
    from local_worker import start_worker, stop_worker

    worker = start_worker(baked_model_path, tmp_path / "worker.log", SHUTDOWN_GRACE_SECONDS="0")
    body = {
        "model": model_name,
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    text, signalled = "", False
    try:
        with (
            httpx.Client(base_url=worker.base, timeout=None) as http,
            http.stream("POST", f"{ENDPOINT}/openai/v1/messages", json=body) as reply,
        ):
            assert reply.status_code == 200
            for chunk in reply.iter_text():
                text += chunk
                if not signalled and "content_block_delta" in text:
                    worker.process.send_signal(signal.SIGTERM)  # once the answer is being written
                    signalled = True
    finally:
        stop_worker(worker)
    events = sse_events(text)
    check_stream(events)
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "overloaded_error"
    assert any(e["type"] == "content_block_delta" for e in events)
