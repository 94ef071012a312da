"""Reasoning output: the model's thinking split from its answer, the way the template set it up.

Qwen3 writes `<think> ... </think>` itself (unless its template opened it in the prompt, as the 2507 thinking
models' do, or closed it empty for `enable_thinking: false`); DeepSeek-R1's template pre-fills `<think>`, and
its older distills write no opening tag at all. Gemma 4 thinks in a channel, `<|channel>thought\n ...
<channel|>` (its template turns thinking on with `<|think|>` in the system turn, and pre-fills the channel
closed and empty when thinking is off); the `thought` label is markup, not reasoning. So whether an answer
starts inside the reasoning is read from the end of the rendered prompt, and `deepseek_r1` assumes it does
when the prompt does not say. The parser is picked from the chat template (the tags it mentions), or set by
REASONING_PARSER.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.sample.structured.spec import StructuredSpec
from worker.openai.tools.parser import held_prefix


@dataclass(frozen=True)
class Tags:
    """How a family marks its reasoning: `open` and `close` around it, `label` right after `open` (markup)."""

    open: str
    close: str
    label: str = ""


THINK = Tags("<think>", "</think>")
CHANNEL = Tags("<|channel>", "<channel|>", "thought\n")
SEED_THINK = Tags("<seed:think>", "</seed:think>")
TAGS = {"qwen3": THINK, "deepseek_r1": THINK, "gemma4": CHANNEL, "seed_oss": SEED_THINK}
KINDS = tuple(TAGS)
OPEN, CLOSE = THINK.open, THINK.close
_GEMMA4_MARKER = CHANNEL.open + "thought"

Part = Literal["reasoning", "content", "markup"]


@dataclass
class Piece:
    """A run of the generated text: reasoning, answer content, or the tags (and spacing) around them."""

    part: Part
    text: str


def pick_reasoning(template: str | None, override: str | None) -> str | None:
    """The reasoning parser for a chat template: REASONING_PARSER when set ("none" turns it off), else by the tags."""
    if override and override != "auto":
        return None if override == "none" else override
    if template and _GEMMA4_MARKER in template:
        return "gemma4"
    if template and SEED_THINK.open in template:
        return "seed_oss"
    if not template or OPEN not in template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"


def starts_in_reasoning(kind: str, prompt: str) -> bool:
    """Whether the answer begins inside the reasoning: the prompt left it open (or, for DeepSeek-R1, did not
    close it)."""
    tags = TAGS.get(kind, THINK)
    tail = prompt.rstrip()
    if tail.endswith(tags.open) or (tags.label and tail.endswith(tags.open + tags.label.rstrip())):
        return True
    return kind == "deepseek_r1" and not tail.endswith(CLOSE)


def closes_reasoning(prompt: str) -> bool:
    """Whether the prompt ends by closing the reasoning (Qwen3's and Gemma 4's templates with thinking off)."""
    tail = prompt.rstrip()
    return any(tail.endswith(tags.close) for tags in TAGS.values())


def reasoning_first(kind: str | None, prompt: str) -> str | None:
    """The reasoning parser when the answer may reason before it answers; None without one, or when the prompt
    closed the reasoning (Qwen3's `enable_thinking: false`)."""
    return None if kind is None or closes_reasoning(prompt) else kind


# Whitespace a constrained answer may put between the reasoning's close and itself (Qwen3 writes two newlines).
SPACING = 16


def spacing() -> dict[str, Any]:
    return {"type": "regex", "pattern": rf"\s{{0,{SPACING}}}"}


def thought(in_reasoning: bool, kind: str, then: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A structural tag's format for the reasoning a constrained answer may write first, followed by `then`: the
    rest of the block the prompt opened, or an optional whole one."""
    tags = TAGS.get(kind, THINK)
    block: dict[str, Any] = {
        "type": "tag",
        "begin": "" if in_reasoning else tags.open,
        "content": {"type": "any_text"},
        "end": tags.close,
    }
    if then:
        block = {"type": "sequence", "elements": [block, *then]}
    return block if in_reasoning else {"type": "optional", "content": block}


def after_reasoning(
    spec: StructuredSpec | None, kind: str | None, in_reasoning: bool, prompt: str
) -> StructuredSpec | None:
    """A request's own constraint held from the end of the reasoning the model may write first, as vLLM applies
    structured outputs only past its reasoning parser's end. Held from the first token, it would keep a thinking
    model from thinking, and make one whose template opened the reasoning write its answer inside it.

    A regex, grammar or structural tag that spells out the reasoning's close itself covers the reasoning, and is
    kept as it is (held after the reasoning, it would make the model think twice)."""
    kind = reasoning_first(kind, prompt)
    if spec is None or kind is None:
        return spec
    if spec.kind in ("regex", "grammar", "structural_tag") and TAGS.get(kind, THINK).close in spec.value:
        return spec
    prefix = thought(in_reasoning, kind, (spacing(),))
    return dataclasses.replace(spec, prefix=json.dumps(prefix, ensure_ascii=False))


class ReasoningParser:
    """One answer's reasoning split: `push(delta) -> pieces`, then `finish() -> pieces`.

    `end` is the offset in the text just past the reasoning (its closing tag included) once it has ended;
    token counting reads it.
    """

    def __init__(self, in_reasoning: bool, kind: str = "qwen3") -> None:
        self.tags = TAGS.get(kind, THINK)
        self.state = "open" if in_reasoning else "start"
        self.buffer = ""
        self.seen = 0  # characters of the text consumed
        self.end: int | None = None
        self.had_reasoning = in_reasoning

    def push(self, text: str) -> list[Piece]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        pieces = self._run(final=True)
        if self.buffer:
            pieces.append(
                Piece("reasoning" if self.state in ("open", "label", "reasoning") else "content", self.buffer)
            )
            self._take(len(self.buffer))
        return [p for p in pieces if p.text]

    def _take(self, n: int) -> str:
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        self.seen += n
        return taken

    def _run(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        tags = self.tags
        while self.buffer:
            stripped = self.buffer.lstrip()
            if self.state in ("start", "open"):
                # The first thing written may (again) be the opening tag.
                if stripped.startswith(tags.open):
                    pieces.append(Piece("markup", self._take(len(self.buffer) - len(stripped) + len(tags.open))))
                    self.state, self.had_reasoning = "label" if tags.label else "reasoning", True
                elif not final and (not stripped or tags.open.startswith(stripped)):
                    break
                else:
                    self.state = "reasoning" if self.state == "open" else "content"
            elif self.state == "label":
                if self.buffer.startswith(tags.label):
                    pieces.append(Piece("markup", self._take(len(tags.label))))
                elif not final and tags.label.startswith(self.buffer):
                    break
                self.state = "reasoning"
            elif self.state == "reasoning":
                at = self.buffer.find(tags.close)
                if at < 0:
                    keep = 0 if final else held_prefix(self.buffer, (tags.close,))
                    pieces.append(Piece("reasoning", self._take(len(self.buffer) - keep)))
                    break
                pieces.append(Piece("reasoning", self._take(at)))
                pieces.append(Piece("markup", self._take(len(tags.close))))
                self.end = self.seen
                self.state = "after"
            elif self.state == "after":
                # The spacing between the reasoning and the answer belongs to neither.
                spacing = len(self.buffer) - len(stripped)
                if spacing:
                    pieces.append(Piece("markup", self._take(spacing)))
                if not self.buffer:
                    break
                self.state = "content"
            else:
                pieces.append(Piece("content", self._take(len(self.buffer))))
        return [p for p in pieces if p.text]
