"""A chat request for a gpt-oss model: the harmony prompt, how its answer is read and what constrains it.

tool_choice "none" shows no tools; a named function is forced by ending the prompt with that call's header
(`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`) and holding the arguments to its
schema with the grammar; "required" ends the prompt with `<|channel|>commentary to=functions.`, so the answer is
a call and the model picks the function (the grammar engine blanks special tokens, so it cannot spell the
header's `<|constrain|>` / `<|message|>` after a name it chose). A structured-output constraint
(response_format and the like) opens the final channel in the prompt, so the grammar holds the answer from
its first token; the model then writes no analysis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.sample.params import SamplingParams
from engine.sample.structured.spec import StructuredSpec
from worker.openai.chat_template import ChatPrompt, template_messages
from worker.openai.errors import BadRequest
from worker.openai.harmony.output import HarmonyFormat

__all__ = ["HarmonyFormat", "harmony_chat", "harmony_request"]
from worker.openai.harmony.render import ResponseFormat, conversation, render
from worker.openai.tools.constraints import ANY_OBJECT
from worker.openai.tools.definitions import check_tool_choice, check_tools
from worker.openai.tools.plan import ToolPlan

FINAL = "<|channel|>final<|message|>"
CALL_HEADER = "<|channel|>commentary to=functions."
CALL_OPEN = " <|constrain|>json<|message|>"


def harmony_request(
    encoding: Any, request: Any, params: SamplingParams
) -> tuple[ChatPrompt, ToolPlan, HarmonyFormat, SamplingParams]:
    """A ChatCompletionRequest's prompt, tool plan, answer reader and the sampling parameters the format needs."""
    effort = getattr(request, "reasoning_effort", None) or (request.chat_template_kwargs or {}).get("reasoning_effort")
    so = getattr(request, "structured_outputs", None)
    return harmony_chat(
        encoding,
        request.messages,
        params,
        tools=request.tools,
        tool_choice=request.tool_choice,
        parallel=request.parallel_tool_calls is not False,
        separate_reasoning=request.separate_reasoning,
        response_format=request.response_format,
        reasoning_effort=effort,
        continue_final_message=request.continue_final_message,
        any_whitespace=not (so is not None and so.disable_any_whitespace),
    )


def harmony_chat(
    encoding: Any,
    messages: list[Any],
    params: SamplingParams,
    *,
    tools: list[Any] | None,
    tool_choice: Any,
    parallel: bool = True,
    separate_reasoning: bool = True,
    response_format: Any = None,
    reasoning_effort: str | None = None,
    continue_final_message: bool = False,
    any_whitespace: bool = True,
) -> tuple[ChatPrompt, ToolPlan, HarmonyFormat, SamplingParams]:
    """The prompt, the tool plan, the answer's reader and the sampling parameters the format needs;
    any_whitespace False (structured_outputs.disable_any_whitespace): a forced call's JSON has no free spaces."""
    if continue_final_message:
        raise BadRequest(
            "continue_final_message is not supported with the harmony format", param="continue_final_message"
        )
    checked = check_tools(tools)
    plan = ToolPlan("harmony", checked, check_tool_choice(tool_choice, checked), parallel)
    plain = template_messages(messages)
    conv = conversation(plain, plan.tools if plan.active else [], reasoning_effort, _response_format(response_format))
    forced, structured = "", params.structured
    mode, name = plan.choice.mode, plan.choice.name
    if mode == "required" and len(plan.tools) == 1:
        mode, name = "named", plan.tools[0].name
    if mode in ("named", "required") and params.structured is not None:
        raise BadRequest(
            f"tool_choice {mode!r} constrains the answer to tool calls, which conflicts with the "
            f"request's {params.structured.param}",
            param="tool_choice",
        )
    if mode == "named":
        tool = next(t for t in plan.tools if t.name == name)
        forced = f"{CALL_HEADER}{name}{CALL_OPEN}"
        structured = StructuredSpec.json_schema(tool.parameters or ANY_OBJECT, "tools", any_whitespace)
    elif mode == "required":
        forced = CALL_HEADER
    elif structured is not None:
        forced = FINAL
    ids = render(encoding, conv, forced)
    forced_ids = tuple(encoding.encode(forced, allowed_special="all")) if forced else ()
    stops = sorted(set(params.stop_token_ids or ()) | set(encoding.stop_tokens_for_assistant_actions()))
    params = dataclasses.replace(params, structured=structured, stop_token_ids=stops)
    prompt = ChatPrompt(encoding.decode(ids), ids, plain)
    return (
        prompt,
        plan,
        HarmonyFormat(encoding=encoding, forced=forced_ids, separate_reasoning=separate_reasoning),
        params,
    )


def _response_format(fmt: Any) -> ResponseFormat | None:
    """response_format's json_schema as harmony shows it (its `# Response Formats` section)."""
    if fmt is None or fmt.type != "json_schema" or fmt.json_schema is None:
        return None
    schema = fmt.json_schema.schema_
    return ResponseFormat(fmt.json_schema.name or "response", schema if isinstance(schema, dict) else {})
