"""Checking a request's `tools` and `tool_choice`: a malformed one is a 400 that names the parameter.

OpenAI's rules: each tool is `{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}`, names are 1 to 64 of [A-Za-z0-9_-] and unique, `parameters` is a JSON schema object, and
`tool_choice` is "none", "auto", "required" or `{"type": "function", "function": {"name": <a tool>}}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from worker.openai.errors import BadRequest

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclass(kw_only=True)
class Tool:
    """One function tool as the request defined it (`spec` is the request's dict, for the chat template)."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None
    spec: dict[str, Any] = field(repr=False)


def check_tools(tools: list[Any] | None) -> list[Tool]:
    """The request's tools, checked; raises BadRequest naming `tools[i]...`."""
    out: list[Tool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        if tool.get("type", "function") != "function":
            raise BadRequest(f"{where}.type must be 'function', got {tool.get('type')!r}", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise BadRequest(f"{where}.function must be an object with the function's name", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequest(
                f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise BadRequest(
                f"{where}.function.name {name!r} is defined twice; tool names must be unique",
                param=f"{where}.function.name",
            )
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
        parameters = function.get("parameters")
        is_object = isinstance(parameters, dict) and parameters.get("type", "object") == "object"
        if parameters is not None and not is_object:
            raise BadRequest(
                f"{where}.function.parameters must be a JSON schema of type 'object'",
                param=f"{where}.function.parameters",
            )
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise BadRequest(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
        out.append(
            Tool(
                name=name,
                description=description,
                parameters=parameters,
                strict=strict,
                spec={"type": "function", "function": function},
            )
        )
    return out


@dataclass(frozen=True)
class ToolChoice:
    """`mode` is "none", "auto", "required" or "named" (then `name` is the function every answer calls)."""

    mode: str
    name: str | None = None


def check_tool_choice(choice: Any, tools: list[Tool]) -> ToolChoice:
    """The request's tool_choice, checked (unset: "auto" with tools, else "none"); raises BadRequest."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise BadRequest(
                f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {choice!r}",
                param="tool_choice",
            )
        if choice == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs tools", param="tool_choice")
        return ToolChoice(choice if tools else "none")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in {t.name for t in tools}:
        raise BadRequest(f"tool_choice names the function {name!r}, which is not among the tools", param="tool_choice")
    return ToolChoice("named", name)
