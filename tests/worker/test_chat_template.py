"""Chat template rendering with the baked model's real tokenizer."""

from __future__ import annotations

import pytest

from worker.openai.chat_template import render_chat
from worker.openai.errors import BadRequest

USER = [{"role": "user", "content": "Hi there"}]


def test_the_models_template_with_a_generation_prompt(tokenizer) -> None:
    prompt = render_chat(tokenizer, USER)
    assert prompt.text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.token_ids == tokenizer.encode(prompt.text, add_special_tokens=False)
    without = render_chat(tokenizer, USER, add_generation_prompt=False)
    assert without.text.endswith("Hi there<|im_end|>\n")


def test_continue_final_message_leaves_the_last_message_open(tokenizer) -> None:
    messages = USER + [{"role": "assistant", "content": "The answer is"}]
    prompt = render_chat(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.text.endswith("<|im_start|>assistant\nThe answer is")


def test_text_content_parts_are_joined_and_other_parts_rejected(tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert "Hi\nthere<|im_end|>" in render_chat(tokenizer, parts).text
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(BadRequest) as info:
        render_chat(tokenizer, image)
    assert info.value.param == "messages.[0].content"


def test_custom_template_kwargs_and_documents_reach_the_template(tokenizer) -> None:
    template = (
        "{% for d in documents %}[{{ d.title }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}{{ flavour }}"
    )
    prompt = render_chat(
        tokenizer,
        USER,
        chat_template=template,
        documents=[{"title": "Doc", "text": "t"}],
        template_kwargs={"flavour": "mint", "add_generation_prompt": "ignored"},
    )
    assert prompt.text == "[Doc]user:Hi there|mint"


def test_a_broken_template_is_a_bad_request_naming_chat_template(tokenizer) -> None:
    with pytest.raises(BadRequest) as info:
        render_chat(tokenizer, USER, chat_template="{% for %}")
    assert info.value.param == "chat_template"
    with pytest.raises(BadRequest):
        render_chat(tokenizer, USER, chat_template="{{ raise_exception('no system role') }}")
