"""The <think> reasoning split: picked from the template, starting where the prompt left off, streamed at every
split, tool calls read only after the reasoning, and its tokens counted."""

from __future__ import annotations

import pytest
from family_templates import DEEPSEEK_R1, GEMMA4, LLAMA31, QWEN3, QWEN3_THINKING, QWEN25

from worker.openai.chat_output import OutputFormat, reasoning_tokens
from worker.openai.reasoning import closes_reasoning, pick_reasoning, starts_in_reasoning
from worker.openai.tools.gemma4 import Gemma4Parser
from worker.openai.tools.hermes import HermesParser

QWEN3_ANSWER = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
G_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


def test_the_parser_is_picked_from_the_template_unless_set() -> None:
    assert pick_reasoning(QWEN3, None) == "qwen3" and pick_reasoning(QWEN3_THINKING, "auto") == "qwen3"
    assert pick_reasoning(DEEPSEEK_R1, None) == "deepseek_r1"
    assert pick_reasoning(QWEN25, None) is None and pick_reasoning(LLAMA31, None) is None
    assert pick_reasoning(QWEN25, "qwen3") == "qwen3" and pick_reasoning(QWEN3, "none") is None
    assert pick_reasoning(GEMMA4, None) == "gemma4" and pick_reasoning(QWEN3, "gemma4") == "gemma4"


def test_where_the_answer_starts_is_read_from_the_prompt() -> None:
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n")
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")  # opened by the template
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking off
    assert starts_in_reasoning("deepseek_r1", "<｜Assistant｜><think>\n")
    assert starts_in_reasoning("deepseek_r1", "<｜Assistant｜>")  # R1 distills may skip the opening tag
    # Gemma 4: thinking on leaves the model to open the channel; off, the template closes it empty.
    assert not starts_in_reasoning("gemma4", "<|turn>model\n")
    assert not closes_reasoning("<|turn>model\n") and closes_reasoning("<|turn>model\n<|channel>thought\n<channel|>")
    assert starts_in_reasoning("gemma4", "<|turn>model\n<|channel>thought\n")


CASES = [
    # (format, answer, reasoning, content, call names)
    (
        OutputFormat(reasoning="qwen3"),
        QWEN3_ANSWER,
        "\nThe user greets me. I should greet back.\n",
        "Hello! How can I help?",
        [],
    ),
    (OutputFormat(reasoning="qwen3"), "Hello without thinking.", None, "Hello without thinking.", []),
    (
        OutputFormat(reasoning="qwen3", in_reasoning=True),
        "Opened by the template.\n</think>\n\nAnswer.",
        "Opened by the template.\n",
        "Answer.",
        [],
    ),
    (
        OutputFormat(reasoning="deepseek_r1", in_reasoning=True),
        "Okay, 6 * 7 = 42.\n</think>\n\nThe answer is 42.",
        "Okay, 6 * 7 = 42.\n",
        "The answer is 42.",
        [],
    ),
    (
        OutputFormat(reasoning="deepseek_r1", in_reasoning=True),
        "Cut short while still thinking",
        "Cut short while still thinking",
        "",
        [],
    ),
    (
        OutputFormat(tool_parser=HermesParser, reasoning="qwen3"),
        f"<think>\nMaybe {CALL} later.\n</think>\n\nChecking.\n{CALL}",
        f"\nMaybe {CALL} later.\n",
        "Checking.",
        ["get_weather"],
    ),
    (
        OutputFormat(tool_parser=HermesParser, reasoning="qwen3", separate_reasoning=False),
        f"<think>\nPlan.\n</think>\n\n{CALL}",
        None,
        "<think>\nPlan.\n</think>\n\n",
        ["get_weather"],
    ),
    # Gemma 4: the channel's `thought` label is markup; calls inside the thinking are thinking.
    (
        OutputFormat(reasoning="gemma4"),
        "<|channel>thought\nThe user greets me.<channel|>Hello!",
        "The user greets me.",
        "Hello!",
        [],
    ),
    (
        OutputFormat(reasoning="gemma4"),
        "Hello, <|channel> is just text here.",
        None,
        "Hello, <|channel> is just text here.",
        [],
    ),
    (
        OutputFormat(tool_parser=Gemma4Parser, reasoning="gemma4"),
        f"<|channel>thought\nMaybe {G_CALL} later.\n<channel|>Checking.{G_CALL}<|tool_response>",
        f"Maybe {G_CALL} later.\n",
        "Checking.",
        ["get_weather"],
    ),
    (
        OutputFormat(tool_parser=Gemma4Parser, reasoning="gemma4", in_reasoning=True),
        f"Opened by the prompt.<channel|>{G_CALL}",
        "Opened by the prompt.",
        None,
        ["get_weather"],
    ),
]


@pytest.mark.parametrize("fmt,text,reasoning,content,names", CASES)
def test_reasoning_content_and_calls_whole_and_streamed_at_every_split(fmt, text, reasoning, content, names) -> None:
    whole = fmt.parse(text)
    assert (whole.reasoning, whole.content, [c.name for c in whole.tool_calls]) == (reasoning, content, names)
    expected = (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        stream = fmt.stream()
        events = [e for piece in pieces for e in stream.push(piece)] + stream.finish()
        got = stream.result(events)
        assert (got.reasoning, got.content, [(c.name, c.arguments) for c in got.tool_calls]) == expected, pieces


def test_reasoning_tokens_are_the_tokens_up_to_the_closing_tag(tokenizer) -> None:
    reasoning = "<think>\nLet me think about this for a while.\n</think>"
    ids = tokenizer.encode(reasoning + "\n\nThe answer.", add_special_tokens=False)
    _, end = OutputFormat(reasoning="qwen3").read(tokenizer.decode(ids))
    count = reasoning_tokens(tokenizer, ids, end)
    assert tokenizer.decode(ids[:count]).startswith(reasoning) and not tokenizer.decode(ids[: count - 1]).endswith(
        "</think>"
    )
    assert reasoning_tokens(tokenizer, ids, None) == 0
    unfinished = tokenizer.encode("still thinking", add_special_tokens=False)
    _, end = OutputFormat(reasoning="deepseek_r1", in_reasoning=True).read("still thinking")
    assert reasoning_tokens(tokenizer, unfinished, end) == len(unfinished)
