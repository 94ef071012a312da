"""Which tool-call format a model writes: TOOL_CALL_PARSER when set, else read from its chat template, else its
family, else `generic` (the worker describes the tools itself, for templates that know none)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from worker.openai.harmony.encoding import HARMONY_MODEL_TYPES
from worker.openai.tools.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from worker.openai.tools.gemma4 import Gemma4Parser
from worker.openai.tools.generic import GenericParser
from worker.openai.tools.glm4_moe import Glm4MoeParser, Glm47Parser
from worker.openai.tools.hermes import HermesParser
from worker.openai.tools.llama3_json import Llama3JsonParser
from worker.openai.tools.mistral import GraniteParser, MistralParser, Phi4MiniParser
from worker.openai.tools.parser import ToolParser
from worker.openai.tools.qwen3_coder import Qwen3CoderParser, SeedOssParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        GraniteParser,
        Phi4MiniParser,
        Gemma4Parser,
        Qwen3CoderParser,
        SeedOssParser,
        Glm4MoeParser,
        Glm47Parser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        GenericParser,
    )
}
# Markup each family's template writes when it shows tools or calls, most specific first (Qwen3.5's and
# Qwen3-Coder's templates write <tool_call> too, around <function=...> and <parameter=...>, Seed-OSS's the same
# inside <seed:tool_call>; GLM's around
# <arg_key>). DeepSeek's V3 / R1 templates show the arguments in a ```json block, V3.1's bare (deepseek_v31).
_MARKERS = (
    ("<seed:tool_call>", "seed_oss"),
    ("tool▁calls▁begin｜>", "deepseek"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call|>", "granite"),
    ("<|tool|>", "phi4_mini_json"),
    ("<|tool_call>", "gemma4"),
    ("<parameter=", "qwen3_coder"),
    ("<arg_key>", "glm45"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("dictionary of argument name and its value", "llama3_json"),
)
# For templates that take tools but show no markup the worker knows: the family's own format.
_FAMILIES = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen2_5_vl": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "mixtral": "mistral",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "qwen3_5": "qwen3_coder",
    "qwen3_5_moe": "qwen3_coder",
    "qwen3_5_text": "qwen3_coder",
    "glm4_moe": "glm45",
    "glm4_moe_lite": "glm45",
    "seed_oss": "seed_oss",
    "phi3": "phi4_mini_json",
}
# Families whose own format wins over the markup a template shows (Granite 3.1's templates write <tool_call>, which
# would read as Hermes', around a JSON list of calls). Granite 4.0-H (granitemoehybrid) is not one: its template asks
# for Hermes' calls, one JSON object in each <tool_call></tool_call>.
_FAMILY_FIRST = {"granite": "granite", "granitemoe": "granite", "granitemoeshared": "granite"}
_USES_TOOLS = re.compile(r"\btools\b")


def template_text(template: str | dict[str, str] | None) -> str:
    """A tokenizer's chat template as one text (some tokenizers carry several named ones)."""
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template or ""


def pick_format(template: str | None, model_type: str | None, override: str | None = None) -> str:
    """The tool-call format for a model with this chat template and config `model_type`."""
    if override and override != "auto":
        return override
    if model_type in HARMONY_MODEL_TYPES:  # gpt-oss: its calls, reasoning and prompt are harmony's
        return "harmony"
    text = template or ""
    if model_type in _FAMILY_FIRST and _USES_TOOLS.search(text):
        return _FAMILY_FIRST[model_type]
    for marker, name in _MARKERS:
        if marker in text:
            return _deepseek(text) if name == "deepseek" else name
    if _USES_TOOLS.search(text):
        return _FAMILIES.get(model_type or "", "generic")
    return "generic"


def _deepseek(template: str) -> str:
    """V3's and R1's calls (a ```json block after the name's line) or V3.1's (bare JSON after the separator)."""
    return "deepseek_v3" if "```json" in template else "deepseek_v31"


def model_type(model_path: str) -> str | None:
    """config.json's `model_type` of the model folder (None when unreadable)."""
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
