"""Which tool-call format each family's chat template gets, and how tools and tool history reach the prompt."""

from __future__ import annotations

import json

import pytest
from family_templates import DEEPSEEK_R1, GEMMA4, LLAMA31, MISTRAL_V3, QWEN3, QWEN25
from pydantic import ValidationError

from worker.openai.chat_template import render_chat, template_messages
from worker.openai.errors import BadRequest, error_body
from worker.openai.protocol import ChatCompletionRequest
from worker.openai.tools.definitions import ToolChoice, check_tools
from worker.openai.tools.plan import ToolPlan
from worker.openai.tools.registry import pick_format
from worker.settings import SettingsError, load_settings

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0123456789abcdef01234567",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": '{"celsius": 21}'},
]


def test_the_format_comes_from_the_template_then_the_family_then_generic(tokenizer) -> None:
    assert pick_format(QWEN25, "qwen2") == "hermes" and pick_format(QWEN3, "qwen3") == "hermes"
    assert pick_format(LLAMA31, "llama") == "llama3_json"
    assert pick_format(MISTRAL_V3, "mistral") == "mistral"
    # Templates that know no tools (the default model's ChatML, DeepSeek-R1's short form) get the generic one.
    assert pick_format(tokenizer.chat_template, "llama") == "generic" and pick_format(DEEPSEEK_R1, "qwen2") == "generic"
    # A template that takes tools with markup of its own: the family decides.
    assert pick_format("{% for t in tools %}{{ t | tojson }}{% endfor %}", "qwen3") == "hermes"
    # Qwen2.5-VL (olmOCR-2 too): its tokenizer's template is Qwen2.5's; one that shows tools otherwise, the family's
    assert pick_format(QWEN25, "qwen2_5_vl") == "hermes"
    assert pick_format("{% for t in tools %}{{ t | tojson }}{% endfor %}", "qwen2_5_vl") == "hermes"
    assert pick_format(QWEN25, "qwen2", "mistral") == "mistral" and pick_format(QWEN25, "qwen2", "auto") == "hermes"
    # Gemma 4: by its template's <|tool_call> markup, or by the family when the template shows tools otherwise.
    assert pick_format(GEMMA4, "gemma4_text") == "gemma4" and pick_format(GEMMA4, None) == "gemma4"
    assert pick_format("{% for t in tools %}{{ t | tojson }}{% endfor %}", "gemma4") == "gemma4"


def _render(tokenizer, fmt: str, template: str | None, messages: list, choice: str = "auto") -> str:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": [WEATHER]})
    plan = ToolPlan(fmt, check_tools([WEATHER]), ToolChoice(choice))
    shown, tools = plan.template_inputs(template_messages(request.messages))
    return render_chat(tokenizer, shown, chat_template=template, tools=tools).text


def test_a_second_turn_renders_through_each_familys_template(tokenizer) -> None:
    qwen = _render(tokenizer, "hermes", QWEN25, HISTORY)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in qwen
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in qwen and '"description": "The weather' in qwen
    llama = _render(tokenizer, "llama3_json", LLAMA31, [{"role": "system", "content": "Be brief."}, *HISTORY])
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in llama and "ipython" in llama
    # Mistral's template insists on 9-character ids: the worker's ids end in 9 alphanumerics.
    mistral = _render(tokenizer, "mistral", MISTRAL_V3, HISTORY)
    assert '"id": "f01234567"' in mistral and '"call_id": "f01234567"' in mistral
    assert "[AVAILABLE_TOOLS]" in mistral
    # Gemma 4: the tools declared in the system turn, the call in its own syntax, the result in the model's turn,
    # which the answer then continues (no new turn is opened).
    gemma = _render(tokenizer, "gemma4", GEMMA4, HISTORY)
    assert (
        '<|turn>system\n<|tool>declaration:get_weather{description:<|"|>The weather in a city.<|"|>,parameters:'
        '{properties:{city:{type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|>'
        "<turn|>"
    ) in gemma
    assert gemma.endswith(
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>{"celsius": 21}<|"|>}<tool_response|>'
    )


def test_gemma4_markup_that_is_special_tokens_stays_in_the_text(tokenizer) -> None:
    """Gemma 4's <|tool_call> and <|channel> are special tokens in its vocabulary: an answer read for calls or for
    reasoning keeps special tokens in its text (otherwise the detokenizer drops the markup the parsers read)."""
    import copy

    gemma_like = copy.deepcopy(tokenizer)
    gemma_like.add_special_tokens({"additional_special_tokens": ["<|tool_call>", "<|channel>"]})
    tools = ToolPlan("gemma4", check_tools([WEATHER]), ToolChoice("auto"))
    plain = ToolPlan("gemma4", [], ToolChoice("auto"))
    assert tools.keeps_special_tokens(gemma_like) and plain.keeps_special_tokens(gemma_like, "gemma4")
    assert not plain.keeps_special_tokens(gemma_like) and not plain.keeps_special_tokens(gemma_like, "qwen3")
    assert not tools.keeps_special_tokens(tokenizer, "gemma4")  # plain text in the default model's vocabulary


def test_the_generic_format_describes_tools_and_history_as_plain_turns(tokenizer) -> None:
    text = _render(
        tokenizer,
        "generic",
        None,
        [
            {"role": "system", "content": "Be brief."},
            *HISTORY,
            {"role": "tool", "tool_call_id": "x", "content": "second result"},
        ],
    )
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert "<tool_call></tool_call>" in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>"
    ) in text
    # Both results of the turn share one user turn.
    # (In words naming the function, not <tool_response> tags: the default model copies tags back as its answer.)
    assert (
        '<|im_start|>user\nThe function get_weather returned:\n{"celsius": 21}\nA function returned:\n'
        "second result\n\nAnswer with this result.<|im_end|>"
    ) in text
    none = _render(tokenizer, "generic", None, HISTORY, choice="none")
    assert "# Tools" not in none and "get_weather returned" in none  # no tools offered, the history still shown


def test_where_the_template_refuses_a_system_turn_the_tools_open_the_first_user_turn(tokenizer) -> None:
    from test_gemma_serving import GEMMA2_TEMPLATE

    from worker.openai.chat_template import takes_system_turn

    assert not takes_system_turn(tokenizer, GEMMA2_TEMPLATE) and takes_system_turn(tokenizer, tokenizer.chat_template)
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": [WEATHER]})
    plan = ToolPlan("generic", check_tools([WEATHER]), ToolChoice("auto"))
    shown, _ = plan.template_inputs(template_messages(request.messages), system_turn=False)
    assert [m["role"] for m in shown] == ["user", "assistant", "user"]
    assert shown[0]["content"].startswith("# Tools") and shown[0]["content"].endswith("\n\nWeather in Paris?")
    text = render_chat(tokenizer, shown, chat_template=GEMMA2_TEMPLATE).text
    assert "<start_of_turn>user\n# Tools" in text and "system" not in text
    # A conversation with no user turn yet gets one holding the tools; a user's own system turn still meets the
    # template's refusal (Gemma 2 takes none), as the served 400 says.
    alone, _ = plan.template_inputs([{"role": "assistant", "content": "Hi."}], system_turn=False)
    assert alone[0]["role"] == "user" and alone[0]["content"].startswith("# Tools")


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools[0].function.parameters"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([WEATHER], {"type": "function", "function": {"name": "absent"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
        ({"not": "a list"}, None, "tools"),
    ],
)
def test_malformed_tools_are_400s_naming_the_parameter(tools, choice, param) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    with pytest.raises((BadRequest, ValidationError)) as info:
        ChatCompletionRequest.model_validate(body)
    error = error_body(info.value)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_override_variables_are_checked_and_read_case_blind() -> None:
    settings = load_settings({"TOOL_CALL_PARSER": " Hermes ", "REASONING_PARSER": "NONE"})
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("hermes", "none")
    assert (load_settings({}).tool_call_parser, load_settings({}).reasoning_parser) == ("auto", "auto")
    for name, value in (("TOOL_CALL_PARSER", "pythonic"), ("REASONING_PARSER", "granite")):
        with pytest.raises(SettingsError) as info:
            load_settings({name: value})
        assert name in str(info.value)
