"""`truncation: "auto"` on /v1/responses drops the oldest whole turns, never part of one, and renders the
prompt a bounded number of times."""

from __future__ import annotations

import math

import openai
import pytest
from openai_schema import validate

from worker.openai.responses.truncation import fit_turns

# ChatML as the baked model writes it, but refusing a conversation that does not alternate user/assistant
# (as Mistral v0.1's and Gemma's templates do).
ALTERNATING = (
    "{%- for m in messages if m.role == 'system' %}{{ '<|im_start|>system\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- for m in messages | rejectattr('role', 'equalto', 'system') %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _turns(count: int) -> list[dict[str, str]]:
    turns = []
    for i in range(count):  # about 200 tokens a turn against the test worker's 2,048-token context
        turns += [
            {"role": "user", "content": f"Note {i}: " + "the quick brown fox jumps " * 40},
            {"role": "assistant", "content": f"Noted {i}."},
        ]
    return turns


def test_auto_truncation_keeps_the_most_recent_whole_turns(client, model_name) -> None:
    turns = [*_turns(12), {"role": "user", "content": "Which notes do you remember?"}]
    ask = {"max_output_tokens": 8, "temperature": 0, "extra_body": {"chat_template": ALTERNATING}}
    fitted = client.responses.create(model=model_name, input=turns, truncation="auto", **ask)
    validate(fitted)
    # The same answer as the longest suffix of whole turns that fits, sent as it is.
    for start in range(0, len(turns), 2):
        try:
            whole = client.responses.create(model=model_name, input=turns[start:], **ask)
            break
        except openai.BadRequestError as exc:
            assert exc.body["code"] == "context_length_exceeded"
    assert start > 0
    assert fitted.usage.input_tokens == whole.usage.input_tokens and fitted.output_text == whole.output_text


def test_a_last_turn_too_long_alone_is_still_refused(client, model_name) -> None:
    huge = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "the quick brown fox jumps " * 500},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model_name, input=huge, truncation="auto", max_output_tokens=8)
    assert refused.value.body["code"] == "context_length_exceeded" and refused.value.body["param"] == "input"


@pytest.mark.parametrize("keep", [1, 5, 63, 64])
def test_the_prompt_is_rendered_a_logarithmic_number_of_times(keep: int) -> None:
    """64 turns (one with a tool call and its result) where only the last `keep` fit: the kept conversation is
    those turns whole, system message first, and about log2(64) renders find it."""
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(64):
        messages += [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}"}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "r"},
            {"role": "assistant", "content": f"a{i}"},
        ]
    rendered: list[list[dict]] = []

    def render(kept: list[dict]) -> list[dict]:
        rendered.append(kept)
        return kept

    kept = fit_turns(messages, render, lambda m: sum(x["role"] == "user" for x in m) <= keep)
    assert kept == messages[:1] + messages[1 + 4 * (64 - keep) :]
    assert len(rendered) <= math.ceil(math.log2(64)) + 2
