"""POST /v1/completions: every prompt form, echo, logprobs and the legacy parameters."""

from __future__ import annotations

import openai
import pytest
from openai_schema import validate

PROMPT = "The capital of France is"
REPEAT = "Hello hello hello hello hello"


def complete(client: openai.OpenAI, model: str, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    response = client.completions.create(model=model, prompt=prompt, **kw)
    validate(response)
    return response


def test_default_max_tokens_is_16(client, model_name) -> None:
    response = client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    validate(response)
    assert response.usage.completion_tokens == 16 and response.choices[0].finish_reason == "length"
    assert response.object == "text_completion" and response.id.startswith("cmpl-")


def test_a_null_max_tokens_is_the_legacy_default_not_the_context(client, model_name) -> None:
    """Clients that serialise unset fields send `"max_tokens": null`; it must not run to the context's end."""
    response = client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, max_tokens=None, extra_body={"ignore_eos": True}
    )
    validate(response)
    assert response.usage.completion_tokens == 16 and response.choices[0].finish_reason == "length"


def test_every_prompt_form_gives_the_same_text(client, model_name, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    text = complete(client, model_name).choices[0].text
    assert complete(client, model_name, ids).choices[0].text == text
    batch = complete(client, model_name, [PROMPT, "One, two, three,"])
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == text
    by_ids = complete(client, model_name, [ids, tokenizer.encode("One, two, three,")])
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    single = complete(client, model_name, "One, two, three,")
    assert batch.usage.prompt_tokens == len(ids) + single.usage.prompt_tokens
    assert (
        batch.usage.completion_tokens
        == complete(client, model_name).usage.completion_tokens + single.usage.completion_tokens
    )


def test_n_per_prompt_numbers_choices_prompt_major(client, model_name) -> None:
    response = complete(client, model_name, [PROMPT, "One, two,"], n=2, temperature=1.0, seed=9, max_tokens=3)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]


def test_echo_and_logprobs(client, model_name, tokenizer) -> None:
    plain = complete(client, model_name, logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == plain.usage.completion_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == plain.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) >= 1 for t in lp.top_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob) and max(top.values()) == pytest.approx(logprob, abs=1e-4)
    echoed = complete(client, model_name, echo=True, logprobs=1)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    elp = echoed.choices[0].logprobs
    n_prompt = len(tokenizer.encode(PROMPT))
    assert len(elp.tokens) == n_prompt + plain.usage.completion_tokens
    assert elp.token_logprobs[0] is None and all(x is not None for x in elp.token_logprobs[1:])
    assert elp.text_offset[n_prompt] == len(PROMPT)
    assert elp.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_text_offsets_are_characters_of_the_text_streamed_or_not(client, model_name) -> None:
    # "Fire: 🔥🔥" is 8 characters in 8 tokens: 'Fire', ':', then b" \xf0\x9f", b"\x94", b"\xa5" (the space and
    # the first emoji, started inside the token that holds the space), then the second emoji in three bytes
    # tokens. A token that starts inside a character is at that character.
    prompt = "Fire: 🔥🔥"
    whole = complete(client, model_name, prompt, echo=True, logprobs=1, max_tokens=2)
    offsets = whole.choices[0].logprobs.text_offset
    assert offsets[:9] == [0, 4, 5, 6, 6, 7, 7, 7, 8]
    assert all(a <= b <= len(whole.choices[0].text) for a, b in zip(offsets, offsets[1:], strict=False))
    chunks = [
        validate(c)
        for c in client.completions.create(
            model=model_name, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1, stream=True
        )
    ]
    streamed = [o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
    assert streamed == offsets


def test_echo_with_max_tokens_zero_scores_the_prompt_without_generating(client, model_name, tokenizer) -> None:
    scored = complete(client, model_name, echo=True, max_tokens=0, logprobs=1)
    choice, n_prompt = scored.choices[0], len(tokenizer.encode(PROMPT))
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n_prompt
    assert len(choice.logprobs.tokens) == n_prompt and choice.logprobs.token_logprobs[0] is None
    generating = complete(client, model_name, echo=True, max_tokens=1, logprobs=1).choices[0].logprobs
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(generating.token_logprobs[1:n_prompt], abs=1e-4)
    chunks = [
        validate(c)
        for c in client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=0,
            echo=True,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    choices = [ch for c in chunks for ch in c["choices"]]
    assert "".join(ch["text"] for ch in choices) == PROMPT
    assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    with pytest.raises(openai.BadRequestError) as info:  # without echo there is nothing to return
        complete(client, model_name, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_echo_streams_the_prompt_first(client, model_name) -> None:
    chunks = [
        validate(c)
        for c in client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True
        )
    ]
    assert chunks[0]["choices"][0]["text"] == PROMPT
    whole = complete(client, model_name, max_tokens=3, echo=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text


def test_penalties_change_a_repetitive_greedy_continuation(client, model_name) -> None:
    base = complete(client, model_name, REPEAT, max_tokens=8).choices[0].text
    assert base.count("hello") >= 4  # greedy keeps repeating: the penalties below have something to change
    for knobs in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        changed = complete(client, model_name, REPEAT, max_tokens=8, **knobs).choices[0].text
        assert changed != base and changed.lower().count("hello") < base.count("hello"), knobs


def test_return_token_ids_prompt_logprobs_and_add_special_tokens(client, model_name, tokenizer) -> None:
    response = complete(
        client,
        model_name,
        max_tokens=3,
        extra_body={"return_token_ids": True, "prompt_logprobs": 0, "add_special_tokens": False},
    )
    choice = response.choices[0].model_extra
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == response.choices[0].text
    assert len(choice["prompt_logprobs"]) == len(choice["prompt_token_ids"])


def test_suffix_is_refused_rather_than_dropped(client, model_name) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model_name, suffix="!")
    assert info.value.body["param"] == "suffix"
