"""Chat templates written to each family's published format (condensed from the ones the models ship with,
in templates/), for tests that cannot download them: which tool-call and reasoning format is picked, how
tools and their history render, and the tiny random-weight models served with them."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent / "templates"


def _read(name: str) -> str:
    return (HERE / name).read_text()


# Qwen2.5 (and Hermes 2 Pro / 3): tools in the system turn as <tools>, calls as <tool_call>, results as
# <tool_response> inside a user turn.
QWEN25 = _read("qwen2.5.jinja")
_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
# Qwen3: Qwen2.5's tool format plus thinking; enable_thinking=false closes an empty <think> in the prompt.
QWEN3 = QWEN25.replace(
    _GENERATION_PROMPT,
    (
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{%- endif %}"
    ),
)
# Qwen3 thinking-2507: the template opens <think> itself; the model writes only its closing tag.
QWEN3_THINKING = QWEN25.replace(
    _GENERATION_PROMPT, "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
# Llama 3.1 / 3.2: JSON calls with "parameters", tools in the first user turn, results as ipython turns.
LLAMA31 = _read("llama3.1.jinja")
# Mistral 7B Instruct v0.3: [AVAILABLE_TOOLS] before the last user turn, calls after [TOOL_CALLS], results in
# [TOOL_RESULTS]; call ids must be 9 alphanumeric characters.
MISTRAL_V3 = _read("mistral-v0.3.jinja")
# DeepSeek-R1 (distills): the generation prompt pre-fills <think>; no tool support in this form.
DEEPSEEK_R1 = _read("deepseek-r1.jinja")
assert _GENERATION_PROMPT in QWEN25 and QWEN3 != QWEN25 and QWEN3_THINKING != QWEN25
# Gemma 4: its own markup for turns, tools (<|tool>declaration), calls (<|tool_call>call:NAME{...}), results
# (<|tool_response>) and thinking (<|channel>thought ... <channel|>), trimmed to text and image parts (<|image|>).
GEMMA4 = _read("gemma4.jinja")
# Qwen3.5 / Qwen3.6 (Qwen3-Coder's call format): tools as JSON in <tools> under "# Tools", calls as XML
# (<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>), results as
# <tool_response> in a user turn; the generation prompt opens <think> (enable_thinking=false closes it empty).
# Trimmed to text (no images or videos).
QWEN35 = _read("qwen3.5.jinja")

# Gemma 3's (google/gemma-3-*-it): content as a string or as parts, an image part as <start_of_image>, which the
# processor then expands to the image's soft tokens.
GEMMA3 = _read("gemma3.jinja")
# Qwen3-VL's (Qwen/Qwen3-VL-*-Instruct): an image part as <|vision_start|><|image_pad|><|vision_end|>, whose pad the
# processor (here the engine) widens to the image's soft tokens. Trimmed to text and image parts.
QWEN3_VL = _read("qwen3-vl.jinja")
# Qwen2.5-VL's (Qwen/Qwen2.5-VL-*-Instruct chat_template.json): Qwen3-VL's image part after a default system turn.
QWEN2_5_VL = _read("qwen2.5-vl.jinja")
# Mistral Small 3.1 / 3.2's (Mistral 3): [INST] turns, an image part as [IMG], which the processor (here the engine)
# widens to the image's rows of [IMG] each closed by [IMG_BREAK], the last by [IMG_END]. Trimmed to text and images.
MISTRAL3 = _read("mistral3.jinja")
# GLM-4.5 / 4.6 (GLM-4.7's writes the same calls without newlines): tools as JSON in <tools>, calls as
# <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>, results in <|observation|>;
# enable_thinking=false closes an empty <think></think> in the prompt. Trimmed to text.
GLM45 = _read("glm4.5.jinja")
# DeepSeek V3.1: calls as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...
# <｜tool▁calls▁end｜>; the generation prompt opens <think> with thinking=true, closes it otherwise. Trimmed.
DEEPSEEK_V31 = _read("deepseek-v3.1.jinja")
# Seed-OSS-style calls, written for these tests from vLLM's seed_oss parser (not the release's template): Qwen3-Coder's
# <function=NAME> / <parameter=KEY>VALUE</parameter> inside <seed:tool_call> ... </seed:tool_call>; no thinking.
SEED_OSS = _read("seed-oss.jinja")
# Granite-3.0-style calls, written for these tests from vLLM's granite parser (not the release's template): the tools
# as JSON under available_tools, calls as <|tool_call|> and a JSON list of {"name", "arguments"}.
GRANITE30 = _read("granite-3.0.jinja")
