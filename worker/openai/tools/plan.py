"""ToolPlan: one request's tools, tool_choice and format, and what they change in the prompt and the output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.openai.reasoning import TAGS
from worker.openai.tools.definitions import Tool, ToolChoice
from worker.openai.tools.parser import ToolParser
from worker.openai.tools.prompt import generic_messages, template_messages
from worker.openai.tools.registry import PARSERS


@dataclass
class ToolPlan:
    """`format` is the parser's name (registry.PARSERS); `parallel` False allows one call per answer."""

    format: str
    tools: list[Tool]
    choice: ToolChoice
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is offered the tools (and its answer read for calls)."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def schemas(self) -> dict[str, Any]:
        """Each offered tool's parameters schema by name (formats whose values are not JSON type them by it)."""
        return {t.name: t.parameters for t in self.tools} if self.active else {}

    @property
    def parser(self) -> type[ToolParser] | None:
        return PARSERS[self.format] if self.active else None

    def template_inputs(
        self, messages: list[dict[str, Any]], system_turn: bool = True
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template. With "none" the tools are left out, as the model may not call
        them; the history's calls and results still render. `system_turn`: whether the template takes one."""
        tools = self.tools if self.active else []
        if self.format == "generic":
            return generic_messages(messages, tools, self.parallel, self.choice, system_turn), None
        return template_messages(messages, short_ids=self.format == "mistral"), [t.spec for t in tools] or None

    def keeps_special_tokens(self, tokenizer: Any, reasoning: str | None = None) -> bool:
        """Whether the answer must keep special tokens for the parsers to see its markup (Mistral's [TOOL_CALLS],
        Llama's <|python_tag|>, Gemma 4's <|tool_call>, and Gemma 4's <|channel> around its reasoning are special
        tokens in their vocabularies). `reasoning`: the answer's reasoning parser."""
        parser = self.parser
        markers = (parser.openers if parser is not None else ()) + (
            (TAGS[reasoning].open,) if reasoning in TAGS else ()
        )
        encoder = getattr(tokenizer, "added_tokens_encoder", None) or {}
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        for marker in markers:
            token_id = encoder.get(marker)
            if token_id is not None and getattr(decoder.get(token_id), "special", False):
                return True
        return False
