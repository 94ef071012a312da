"""What the engine hands back per step: token deltas per choice, with logprobs and usage; and what it tells an
observer (the worker's metrics) about each generation request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Logprob:
    token_id: int
    token: str  # the decoded text of this one token (a partial UTF-8 piece shows as escaped bytes, as OpenAI's)
    token_bytes: bytes  # the exact bytes the token stands for (OpenAI's `bytes`; may be part of a character)
    logprob: float


@dataclass
class PositionLogprobs:
    """The chosen token at one position and the top-k alternatives, highest first."""

    chosen: Logprob
    top: list[Logprob] = field(default_factory=list)


@dataclass(kw_only=True)
class CompletionDelta:
    """What one choice produced since the previous RequestOutput (all of it when not streamed)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", set on the choice's last delta
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any


@dataclass(kw_only=True)
class CompletionOutput:
    """Everything one choice produced, joined from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionDelta) -> None:
        """Append one delta of this choice."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(kw_only=True)
class RequestOutput:
    """One increment of a request: deltas for the choices that advanced, plus running usage."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool  # every choice has finished
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # entry 0 is None; sent on the first output
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # over all choices so far
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(kw_only=True)
class PoolingOutput:
    """An embedding request's one and only output: the pooled vector and the prompt it pooled."""

    request_id: str
    embedding: list[float]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(kw_only=True)
class FinishedRequest:
    """A generation request at its end: its token counts, how each choice ended, and how long it took."""

    prompt_tokens: int
    cached_tokens: int  # of the prompt, served from the prefix cache
    generation_tokens: int  # over all choices
    finish_reasons: list[str]  # one per finished choice ("stop", "length", "abort"), one "abort" for a stream closed
    seconds: float  # from generate() to the last output


class RequestObserver(Protocol):
    """Told about every generation request (not embeddings or scores) on the caller's thread, once per output that
    reaches the caller, never per token (engine/core/request_clock.py times them)."""

    def first_token(self, seconds: float) -> None:
        """The first generated tokens arrived, `seconds` after generate() was called."""
        ...

    def next_tokens(self, seconds: float) -> None:
        """More generated tokens arrived, `seconds` after the previous ones."""
        ...

    def finished(self, request: FinishedRequest) -> None: ...
