"""POST /v1/chat/completions through the official openai client against the local endpoint.

Every response and stream chunk is validated against OpenAI's spec (tests/worker/openai_schema.py).
Outputs are compared with other outputs of the same model (greedy vs constrained), never with
hard-coded text.
"""

from __future__ import annotations

import openai
import pytest
from openai_schema import validate

Q = [{"role": "user", "content": "What is the capital of France?"}]
HI = [{"role": "user", "content": "Hi!"}]


def chat(client: openai.OpenAI, model: str, messages=Q, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    response = client.chat.completions.create(model=model, messages=messages, **kw)
    validate(response)
    return response


def extra(response, name: str):
    return (response.model_extra or {})[name]


@pytest.fixture(scope="module")
def greedy(client, model_name):
    """The greedy 8-token answer to Q, with its token ids."""
    return chat(client, model_name, extra_body={"return_token_ids": True})


def test_greedy_chat_is_deterministic_and_well_formed(client, model_name, greedy) -> None:
    again = chat(client, model_name, extra_body={"return_token_ids": True})
    choice = greedy.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.message.annotations == [] and "system_fingerprint" not in greedy.model_fields_set
    assert again.choices[0].message.content == choice.message.content
    assert greedy.id.startswith("chatcmpl-") and greedy.model == model_name and greedy.object == "chat.completion"
    usage = greedy.usage
    assert usage.completion_tokens == len(choice.model_extra["token_ids"]) <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert len(extra(greedy, "prompt_token_ids")) == usage.prompt_tokens


def test_the_model_alias_and_the_baked_name_are_both_accepted(client, model_name, greedy) -> None:
    aliased = chat(client, "test-org/alias-name")
    assert aliased.model == model_name and aliased.choices[0].message.content == greedy.choices[0].message.content


def test_max_completion_tokens_wins_and_ignore_eos_runs_to_the_limit(client, model_name) -> None:
    short = chat(client, model_name, HI, max_tokens=None)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop"  # the model's own end: no limit was set
    long = chat(client, model_name, HI, max_tokens=n, max_completion_tokens=n + 3, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == n + 3
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)
    floor = chat(client, model_name, HI, max_tokens=n + 5, extra_body={"min_tokens": n + 2})
    assert floor.usage.completion_tokens >= n + 2


def test_stop_strings_end_the_text_before_them_unless_asked(client, model_name, greedy) -> None:
    text = greedy.choices[0].message.content
    word = text.split()[2]
    cut = chat(client, model_name, stop=[word, "zzzz"])
    assert cut.choices[0].message.content == text[: text.index(word)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == word
    kept = chat(client, model_name, stop=word, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[: text.index(word) + len(word)]


def test_stop_token_ids(client, model_name, greedy) -> None:
    ids = greedy.choices[0].model_extra["token_ids"]
    response = chat(client, model_name, extra_body={"stop_token_ids": [ids[2]], "return_token_ids": True})
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["token_ids"][:3] == ids[:3]
    assert response.usage.completion_tokens == 3


def test_logprobs_and_top_logprobs(client, model_name, greedy) -> None:
    response = chat(client, model_name, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    # The tokens spell the text (plus the end-of-sequence token when the answer ended on it).
    assert "".join(t.token for t in content).startswith(greedy.choices[0].message.content)
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-4)
        assert bytes(token.bytes) == token.token.encode()
    plain = chat(client, model_name, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


def test_logprob_bytes_are_the_raw_bytes_of_a_token_inside_a_character(client, model_name, tokenizer) -> None:
    half = tokenizer.encode("🔥", add_special_tokens=False)[0]  # the first two of the emoji's four bytes
    response = chat(client, model_name, logprobs=True, max_tokens=1, extra_body={"allowed_token_ids": [half]})
    token = response.choices[0].logprobs.content[0]
    assert bytes(token.bytes) == "🔥".encode()[:2]
    assert token.token == "\\xf0\\x9f"  # the text shows the bytes escaped, as OpenAI's does


def test_logit_bias_forces_a_token(client, model_name, tokenizer) -> None:
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    response = chat(
        client, model_name, logit_bias={str(forced): 100}, max_tokens=4, extra_body={"return_token_ids": True}
    )
    assert response.choices[0].model_extra["token_ids"] == [forced] * 4


def test_allowed_token_ids_and_bad_words(client, model_name, greedy, tokenizer) -> None:
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    response = chat(client, model_name, extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(response.choices[0].model_extra["token_ids"]) <= set(allowed)
    first_word = greedy.choices[0].message.content.split()[0]
    banned = chat(client, model_name, extra_body={"bad_words": [first_word]})
    assert not banned.choices[0].message.content.startswith(first_word)


def test_sampling_filters_that_leave_one_token_match_greedy(client, model_name, greedy) -> None:
    text = greedy.choices[0].message.content
    for knobs in ({"top_p": 1e-9}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}):
        response = chat(client, model_name, temperature=1.0, seed=1, **knobs)
        assert response.choices[0].message.content == text, knobs


def test_seed_makes_sampling_reproducible_and_n_gives_several_choices(client, model_name) -> None:
    a = chat(client, model_name, temperature=1.0, seed=1234, n=3)
    b = chat(client, model_name, temperature=1.0, seed=1234, n=3)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # each choice draws its own stream


def test_best_of_and_beam_search(client, model_name) -> None:
    best = chat(client, model_name, temperature=1.0, seed=3, extra_body={"best_of": 3})
    assert len(best.choices) == 1 and best.choices[0].message.content
    beams = chat(client, model_name, n=2, extra_body={"use_beam_search": True, "length_penalty": 1.0})
    assert len(beams.choices) == 2 and beams.choices[0].message.content != beams.choices[1].message.content


def test_special_tokens_in_the_output(client, model_name, tokenizer) -> None:
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    bias = {str(start): 100}
    hidden = chat(client, model_name, logit_bias=bias, max_tokens=2)
    assert hidden.choices[0].message.content == ""
    shown = chat(client, model_name, logit_bias=bias, max_tokens=2, extra_body={"skip_special_tokens": False})
    # The tokenizer's own decode, nothing added between tokens, whichever spaces_between_special_tokens asks (as
    # vLLM's text with a fast tokenizer).
    assert shown.choices[0].message.content == "<|im_start|><|im_start|>"
    tight = chat(
        client,
        model_name,
        logit_bias=bias,
        max_tokens=2,
        extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False},
    )
    assert tight.choices[0].message.content == "<|im_start|><|im_start|>"


def test_template_controls(client, model_name, tokenizer, greedy) -> None:
    ids = extra(greedy, "prompt_token_ids")
    no_prompt = chat(
        client, model_name, max_tokens=1, extra_body={"add_generation_prompt": False, "return_token_ids": True}
    )
    assert extra(no_prompt, "prompt_token_ids") == ids[: -len(tokenizer.encode("<|im_start|>assistant\n"))]
    template = (
        "{% for d in documents %}{{ d.text }} {% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
        " {{ style }}"
    )
    custom = chat(
        client,
        model_name,
        max_tokens=1,
        extra_body={
            "chat_template": template,
            "chat_template_kwargs": {"style": "Answer:"},
            "documents": [{"title": "t", "text": "Paris is in France."}],
            "return_token_ids": True,
            "add_special_tokens": True,
        },
    )
    expected = "Paris is in France. What is the capital of France? Answer:"
    assert extra(custom, "prompt_token_ids") == tokenizer.encode(expected, add_special_tokens=True)


def test_continue_final_message_with_echo(client, model_name) -> None:
    messages = Q + [{"role": "assistant", "content": "The capital of France is"}]
    response = chat(
        client,
        model_name,
        messages,
        max_tokens=3,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    content = response.choices[0].message.content
    assert content.startswith("The capital of France is") and len(content) > len("The capital of France is")


def test_truncate_prompt_tokens_and_prompt_logprobs(client, model_name) -> None:
    response = chat(client, model_name, max_tokens=1, extra_body={"truncate_prompt_tokens": 10, "prompt_logprobs": 2})
    assert response.usage.prompt_tokens == 10
    prompt_logprobs = extra(response, "prompt_logprobs")
    assert len(prompt_logprobs) == 10 and prompt_logprobs[0] is None
    assert all(isinstance(p, dict) and p for p in prompt_logprobs[1:])


def test_request_id_body_and_header(client, model_name) -> None:
    by_body = chat(client, model_name, max_tokens=1, extra_body={"request_id": "my-req-1"})
    assert by_body.id == "chatcmpl-my-req-1"
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=Q, max_tokens=1, extra_headers={"X-Request-Id": "hdr-7"}
    )
    assert raw.headers["x-request-id"] == "hdr-7" and raw.parse().id == "chatcmpl-hdr-7"


def test_user_text_response_format_and_unknown_fields_are_accepted(client, model_name, greedy) -> None:
    response = chat(
        client, model_name, user="someone", response_format={"type": "text"}, extra_body={"some_client_field": {"x": 1}}
    )
    assert response.choices[0].message.content == greedy.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:  # structured outputs: the schema is checked first
        chat(client, model_name, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}})
    assert info.value.body["param"] == "response_format"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat(client, model_name, tools=tools, tool_choice="auto").choices[0].message.tool_calls is None
