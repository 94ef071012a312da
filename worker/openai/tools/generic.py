"""`generic`: for models whose chat template knows no tools. The worker describes the tools in the system
prompt (worker/openai/tools/prompt.py) and asks for hermes-style `<tool_call>{...}</tool_call>` blocks,
which this parser reads as the hermes one does (llama.cpp's server serves such models the same way)."""

from __future__ import annotations

from typing import ClassVar

from worker.openai.tools.hermes import HermesParser


class GenericParser(HermesParser):
    name: ClassVar[str] = "generic"
