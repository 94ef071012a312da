"""What the OpenAI and Anthropic routes ask of the running worker: the Runtime protocol.

worker/runtime.py builds the one Runtime (the engine plus the worker's view of it) and satisfies this; the routes
take it as an argument and never import worker/runtime.py, so the arrow points one way: worker -> worker.openai.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from worker.openai.responses.redis_store import RedisResponseStore
    from worker.openai.responses.store import ResponseStore
    from worker.settings import Settings


class Runtime(Protocol):
    """The engine (an AsyncEngine), the settings, the served names and the chat formats of the served model."""

    settings: Settings
    engine: Any  # engine.core.async_engine.AsyncEngine
    model_names: list[str]  # accepted request names; the first is the one responses carry
    created: int  # unix time the model was loaded
    responses: ResponseStore | RedisResponseStore  # stored Responses API responses

    @property
    def served_model_name(self) -> str: ...
    @property
    def adapters(self) -> list[str]: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def tool_format(self) -> str: ...
    @property
    def reasoning_format(self) -> str | None: ...
    @property
    def harmony(self) -> Any: ...

    def template_for(self, chat_template: str | None) -> str: ...
    def formats_for(self, chat_template: str | None) -> tuple[str, str | None]: ...
