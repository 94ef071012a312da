"""A chat request's tools and reasoning: the prompt rendered with the tools as the model's format shows them, how
its answers are read, and the sampling parameters they need (the calls' grammar, the request's own constraint held
after the reasoning)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.sample.params import SamplingParams
from engine.sample.structured.spec import StructuredSpec
from worker.openai.chat_output import OutputFormat
from worker.openai.chat_template import ChatPrompt, render_chat, takes_system_turn, template_messages
from worker.openai.errors import BadRequest
from worker.openai.reasoning import after_reasoning, reasoning_first, starts_in_reasoning
from worker.openai.runtime import Runtime
from worker.openai.tools.constraints import tool_constraint
from worker.openai.tools.definitions import check_tool_choice, check_tools
from worker.openai.tools.plan import ToolPlan


def render_with_tools(
    runtime: Runtime,
    messages: list[Any],
    *,
    tools: list[Any] | None,
    tool_choice: Any,
    parallel: bool = True,
    separate_reasoning: bool = True,
    chat_template: str | None = None,
    **render: Any,
) -> tuple[ChatPrompt, ToolPlan, OutputFormat, StructuredSpec | None]:
    """The prompt with the tools shown as the model's format wants them, how its answers are read, and the grammar
    its calls are held to (None: decoding is free).

    `chat_template` is a request's own template (its formats are read from it); `render` goes to render_chat.
    """
    tool_format, reasoning = (
        runtime.formats_for(chat_template) if chat_template else (runtime.tool_format, runtime.reasoning_format)
    )
    checked = check_tools(tools)
    plan = ToolPlan(tool_format, checked, check_tool_choice(tool_choice, checked), parallel)
    template = runtime.template_for(chat_template)
    system_turn = plan.format != "generic" or not plan.active or takes_system_turn(runtime.tokenizer, template)
    shown, template_tools = plan.template_inputs(template_messages(messages), system_turn)
    prompt = render_chat(
        runtime.tokenizer,
        shown,
        chat_template=chat_template or runtime.settings.custom_chat_template,
        tools=template_tools,
        **render,
    )
    in_reasoning = reasoning is not None and starts_in_reasoning(reasoning, prompt.text)
    output = OutputFormat(
        tool_parser=plan.parser,
        parallel=plan.parallel,
        reasoning=reasoning,
        in_reasoning=in_reasoning,
        separate_reasoning=separate_reasoning,
        max_calls=runtime.settings.max_tool_calls_per_answer,
        schemas=plan.schemas,
        forced=plan.active and plan.choice.mode in ("required", "named"),
    )
    constraint = tool_constraint(
        plan,
        template,
        reasoning_first(reasoning, prompt.text),
        in_reasoning,
        special_trigger=plan.active and plan.keeps_special_tokens(runtime.tokenizer),
    )
    return prompt, plan, output, constraint


def tool_params(
    params: SamplingParams,
    plan: ToolPlan,
    runtime: Runtime,
    constraint: StructuredSpec | None,
    output: OutputFormat,
    prompt: str,
) -> SamplingParams:
    """The sampling parameters with what the tool calls and reasoning need: the request's own constraint held after
    the reasoning, the calls' grammar, special tokens kept in the text when the format's markup is one, and the
    answer's end where its parser takes no further call."""
    changes: dict[str, Any] = {}
    held = after_reasoning(params.structured, output.reasoning, output.in_reasoning, prompt)
    if held is not params.structured:
        changes["structured"] = held
    if plan.keeps_special_tokens(runtime.tokenizer, output.reasoning):
        changes["skip_special_tokens"] = False
    if output.tool_parser is not None:
        changes["stop_reader"] = output.end_reader
    if constraint is not None:
        if params.structured is None:
            changes["structured"] = constraint
        elif plan.choice.mode in ("required", "named"):
            raise BadRequest(
                f"tool_choice {plan.choice.mode!r} constrains the answer to tool calls, which conflicts "
                f"with the request's {params.structured.param}",
                param="tool_choice",
            )
        # With "auto", the request's own constraint wins and calls are read from the free text.
    return dataclasses.replace(params, **changes) if changes else params
