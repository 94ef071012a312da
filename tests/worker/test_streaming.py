"""Streaming exactly as OpenAI streams, through the openai client and as raw SSE."""

from __future__ import annotations

from openai_schema import parse_sse, validate

Q = [{"role": "user", "content": "What is the capital of France?"}]


def _stream(client, model, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    chunks = [validate(c) for c in client.chat.completions.create(model=model, messages=Q, stream=True, **kw)]
    return chunks


def test_chat_stream_shape_matches_openai(client, model_name) -> None:
    whole = client.chat.completions.create(model=model_name, messages=Q, max_tokens=6, temperature=0)
    chunks = _stream(client, model_name, stream_options={"include_usage": True})
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body, usage_chunk = chunks[:-1], chunks[-1]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert usage_chunk["choices"] == []
    assert [usage_chunk["usage"][k] for k in counts] == [getattr(whole.usage, k) for k in counts]
    assert all(c["usage"] is None for c in body)
    finishes = [c for c in body if c["choices"][0]["finish_reason"] is not None]
    assert len(finishes) == 1 and finishes[0] is body[-1] and body[-1]["choices"][0]["delta"] == {}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in body)
    assert text == whole.choices[0].message.content
    assert finishes[0]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason


def test_n_choices_interleave_by_index(client, model_name) -> None:
    chunks = _stream(client, model_name, n=3, temperature=1.0, seed=5)
    indexes = [c["choices"][0]["index"] for c in chunks]
    assert indexes[:3] == [0, 1, 2]  # each choice opens with its role
    assert all(chunks[i]["choices"][0]["delta"]["role"] == "assistant" for i in range(3))
    whole = client.chat.completions.create(model=model_name, messages=Q, max_tokens=6, n=3, temperature=1.0, seed=5)
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert sum(1 for c in mine if c["finish_reason"]) == 1 and mine[-1]["finish_reason"]
        text = "".join(c["delta"].get("content") or "" for c in mine)
        assert text == whole.choices[index].message.content


def test_stream_with_logprobs_and_token_ids(client, model_name) -> None:
    chunks = _stream(
        client,
        model_name,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "stream_options": {"include_usage": True}},
    )
    assert chunks[0]["prompt_token_ids"]
    tokens = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]
    ids = [t for c in tokens for t in c["token_ids"]]
    assert len(ids) == chunks[-1]["usage"]["completion_tokens"]
    entries = [e for c in tokens for e in c["logprobs"]["content"]]
    assert len(entries) == len(ids) and all(len(e["top_logprobs"]) == 2 for e in entries)


def test_raw_sse_body_ends_with_done(http, model_name) -> None:
    body = {"model": model_name, "messages": Q, "max_tokens": 4, "temperature": 0, "stream": True}
    response = http.post("/openai/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events and all(validate(e) for e in events)


def test_completions_stream_matches_the_whole_answer(client, model_name) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    whole = client.completions.create(model=model_name, prompt=prompts, max_tokens=5, temperature=0, n=2)
    chunks = [
        validate(c)
        for c in client.completions.create(
            model=model_name,
            prompt=prompts,
            max_tokens=5,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1]["choices"] == []
    assert [chunks[-1]["usage"][k] for k in counts] == [getattr(whole.usage, k) for k in counts]
    for choice in whole.choices:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice.index]
        assert "".join(c["text"] for c in mine) == choice.text
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice.finish_reason]


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client, model_name) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _stream(client, model_name, extra_body={"stream_options": options})
    final = chunks[-1]["usage"]
    body = chunks[:-1]
    assert all(c["usage"] is not None and c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in body)
    completion = [c["usage"]["completion_tokens"] for c in body]
    assert completion[0] == 0  # the role chunk comes before any token
    assert completion == sorted(completion) and completion[-1] == final["completion_tokens"] > 0

    prompt = "One, two, three,"
    text_chunks = [
        validate(c)
        for c in client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"stream_options": options},
        )
    ]
    final = text_chunks[-1]["usage"]
    completion = [c["usage"]["completion_tokens"] for c in text_chunks[:-1]]
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in text_chunks[:-1])
    assert completion == sorted(completion) and completion[-1] == final["completion_tokens"] == 5
