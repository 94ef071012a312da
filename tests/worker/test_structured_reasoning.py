"""Structured outputs on a thinking model (a tiny random Qwen3 with its chat template): the request's constraint holds
from the end of the reasoning, as vLLM applies it past its reasoning parser. The model may open the reasoning itself,
the template may have opened it, or the prompt closed it (`enable_thinking: false`), and then the constraint holds
from the first token. Chat completions and the Responses API alike."""

from __future__ import annotations

import json

import jsonschema
import pytest
from family_templates import QWEN3, QWEN3_THINKING
from tiny_families import build_family, serve

from worker.openai.chat import prepare_chat
from worker.openai.responses.route import prepare_response

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
ANSWER = '{"city": "Paris", "days": 3}'
ASK = [{"role": "user", "content": "Plan a trip."}]


@pytest.fixture(scope="module")
def qwen3(baked_model_path, tmp_path_factory):
    runtime = serve(build_family("qwen3", baked_model_path, tmp_path_factory.mktemp("qwen3")))
    yield runtime
    runtime.engine.shutdown()


def _takes(runtime, spec, text: str) -> bool:
    """Whether the request's compiled grammar takes `text` and then lets the answer end."""
    import xgrammar as xgr

    engine = runtime.engine.engine
    matcher = xgr.GrammarMatcher(engine.grammars.get(spec))
    return matcher.accept_string(text) and matcher.accept_token(engine.tokenizer.eos_token_id)


def _spec(runtime, **body):
    call = prepare_chat(
        {"model": runtime.served_model_name, "messages": ASK, "response_format": FORMAT, **body}, runtime
    )
    return call.params.structured


def test_the_model_may_think_before_the_constrained_answer(qwen3) -> None:
    spec = _spec(qwen3)
    assert spec.param == "response_format"
    assert _takes(qwen3, spec, f"<think>\nA short trip to Paris.\n</think>\n\n{ANSWER}")
    assert _takes(qwen3, spec, ANSWER)  # thinking stays optional
    assert not _takes(qwen3, spec, f"Sure: {ANSWER}")  # outside the reasoning, only the schema
    assert not _takes(qwen3, spec, '<think>\nHm.\n</think>\n\n{"city": "Oslo", "days": 3}')


def test_reasoning_the_template_opened_is_closed_before_the_answer(qwen3) -> None:
    spec = _spec(qwen3, chat_template=QWEN3_THINKING)
    assert _takes(qwen3, spec, f"A short trip to Paris.\n</think>\n\n{ANSWER}")
    assert not _takes(qwen3, spec, ANSWER)  # still inside the reasoning: the answer has not begun


def test_a_prompt_that_closed_the_reasoning_holds_the_answer_from_its_first_token(qwen3) -> None:
    spec = _spec(qwen3, chat_template_kwargs={"enable_thinking": False})
    assert not spec.prefix
    assert _takes(qwen3, spec, ANSWER)
    assert not _takes(qwen3, spec, f"<think>\nHm.\n</think>\n\n{ANSWER}")


def test_the_responses_api_holds_text_format_after_the_reasoning(qwen3) -> None:
    text = {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}}
    call = prepare_response({"model": qwen3.served_model_name, "input": "Plan a trip.", "text": text}, qwen3)
    spec = call.chat.params.structured
    assert spec.param == "text.format"
    assert _takes(qwen3, spec, f"<think>\nParis.\n</think>\n\n{ANSWER}") and not _takes(qwen3, spec, f"Ok {ANSWER}")


def test_the_sdk_gets_the_schemas_json_as_content_from_a_thinking_template(client, model_name) -> None:
    # The default model under Qwen3's template (so the qwen3 reasoning parser): it may think, then answers.
    answer = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        response_format=FORMAT,
        temperature=0,
        max_tokens=60,
        extra_body={"chat_template": QWEN3},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        response_format=FORMAT,
        temperature=0,
        max_tokens=60,
        extra_body={"chat_template": QWEN3},
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content


def test_a_constraint_that_spells_out_the_reasoning_covers_it(qwen3) -> None:
    thought = "<think>\n[a-z ]{1,20}\n</think>\n\nParis[.]"
    spec = _spec(qwen3, response_format=None, structured_outputs={"regex": thought})
    assert not spec.prefix
    assert _takes(qwen3, spec, "<think>\nthe capital\n</think>\n\nParis.")
    assert not _takes(qwen3, spec, "<think>\nhm\n</think>\n\n<think>\nthe capital\n</think>\n\nParis.")


def test_a_bad_constraint_under_a_thinking_template_is_a_400_and_the_next_request_is_served(client, model_name) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name,
            messages=ASK,
            max_tokens=8,
            extra_body={"chat_template": QWEN3, "structured_outputs": {"regex": "a(b"}},
        )
    assert info.value.status_code == 400 and info.value.body["param"] == "structured_outputs.regex"
    answer = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        response_format=FORMAT,
        temperature=0,
        max_tokens=60,
        extra_body={"chat_template": QWEN3},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
