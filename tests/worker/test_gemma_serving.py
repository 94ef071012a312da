"""Tiny random Gemma 2, 3 and 4 models baked by the builder from hub-layout folders (the default model's tokenizer,
a vocabulary to match, the family's chat template) serve chat through the local endpoint with the official SDK:
whole and streamed answers agree; Gemma 2's template refuses a system turn (a 400 that says so), Gemma 3's folds
it into the first user turn, Gemma 4's keeps it; on each a forced tool call and a json_schema answer fit their schemas
(on Gemma 2 the tools' description opens the first user turn, as its template takes no system turn). Gemma 4 serves
with its own template's formats: calls in `<|tool_call>call:NAME{...}` whole and streamed, a second turn's call and
result rendered by the template, thinking turned on by `enable_thinking`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from family_templates import GEMMA4 as GEMMA4_TEMPLATE
from local_worker import ROOT, LocalWorker, start_worker, stop_worker

# Gemma 2's template as its checkpoints ship it: no system role, turns between <start_of_turn> and <end_of_turn>.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# Gemma 3's (text content only): a system turn becomes a prefix of the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
TEMPLATES = {"gemma2": GEMMA2_TEMPLATE, "gemma3": GEMMA3_TEMPLATE, "gemma4": GEMMA4_TEMPLATE}
PROMPT = [{"role": "user", "content": "Name a colour."}]
SIZES = dict(
    vocab_size=49152,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    query_pre_attn_scalar=8,
    sliding_window=16,
    max_position_embeddings=512,
)


# Gemma 4: local and global layers with their own head sizes, keys as values on the global one, the last layer
# reading the KV of an earlier one, per-layer input embeddings.
GEMMA4 = dict(
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=1,
    layer_types=["sliding_attention", "full_attention"] * 2,
    num_hidden_layers=4,
    hidden_size_per_layer_input=4,
    vocab_size_per_layer_input=49152,
    final_logit_softcapping=30.0,
)


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "gemma4"])
def gemma_worker(
    request: pytest.FixtureRequest, baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalWorker]:
    import transformers as tf

    family = request.param
    root = tmp_path_factory.mktemp(family + "-bake")
    source = root / ("tiny-" + family)
    torch.manual_seed(0)
    if family == "gemma2":
        tf.Gemma2ForCausalLM(tf.Gemma2Config(**SIZES)).save_pretrained(source)
    elif family == "gemma3":  # one local layer (window 16) and one global, as layer_types says
        config = tf.Gemma3TextConfig(**SIZES, layer_types=["sliding_attention", "full_attention"])
        tf.Gemma3ForCausalLM(config).save_pretrained(source)
    else:
        model = tf.AutoModelForCausalLM.from_config(tf.Gemma4TextConfig(**{**SIZES, **GEMMA4}))
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(baked_model_path / name, source / name)
    (source / "chat_template.jinja").write_text(TEMPLATES[family])
    out = root / "model"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    baked = subprocess.run(
        [sys.executable, "-m", "builder", "--model", str(source), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert baked.returncode == 0, baked.stderr
    w = start_worker(out, root / "worker.log", MAX_MODEL_LEN="512")
    w.family = family
    yield w
    stop_worker(w)


def test_chat_whole_and_streamed_agree(gemma_worker: LocalWorker) -> None:
    sdk, name = gemma_worker.client(), "tiny-" + gemma_worker.family
    whole = sdk.chat.completions.create(model=name, messages=PROMPT, temperature=0, max_tokens=12)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    text = whole.choices[0].message.content
    assert text
    stream = sdk.chat.completions.create(model=name, messages=PROMPT, temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_a_system_turn_follows_the_template(gemma_worker: LocalWorker) -> None:
    """Gemma 2: the template's own refusal, as a 400. Gemma 3: the system text joins the first user turn; Gemma 4:
    a turn of its own."""
    sdk, name = gemma_worker.client(), "tiny-" + gemma_worker.family
    with_system = [{"role": "system", "content": "Be brief."}, *PROMPT]
    if gemma_worker.family == "gemma2":
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=name, max_tokens=4, messages=with_system)
        assert "System role not supported" in str(info.value)
        return
    plain = sdk.chat.completions.create(model=name, max_tokens=4, messages=PROMPT)
    folded = sdk.chat.completions.create(model=name, max_tokens=4, messages=with_system)
    assert folded.usage.prompt_tokens > plain.usage.prompt_tokens


CITY_ARG = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY_ARG},
}
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}},
    "required": ["name"],
    "additionalProperties": False,
}


def test_a_forced_tool_call_and_a_json_schema(gemma_worker: LocalWorker) -> None:
    """A required call comes back as a tool call whose arguments fit the schema (Gemma 2's and 3's templates render
    no tools: the generic format; Gemma 4's own format), and a json_schema answer fits its schema (random weights:
    the grammar does the work)."""
    import json

    import jsonschema

    sdk, name = gemma_worker.client(), "tiny-" + gemma_worker.family
    call = sdk.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    calls = call.choices[0].message.tool_calls
    assert call.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    answer = sdk.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "A city?"}],
        response_format=fmt,
        max_tokens=64,
        temperature=0,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY)


def _gemma4_only(worker: LocalWorker) -> None:
    if worker.family != "gemma4":
        pytest.skip("Gemma 4's own tool and thinking formats")


def _prompt(tokenizer, response) -> str:
    return tokenizer.decode((response.model_extra or {})["prompt_token_ids"], skip_special_tokens=False)


def test_gemma4_a_forced_call_streams_in_its_own_format(gemma_worker: LocalWorker) -> None:
    """The grammar holds the random model to `<|tool_call>call:get_weather{city:<|"|>...<|"|>}<tool_call|>`; the
    parser turns it into an OpenAI call with JSON arguments, the same whole and streamed."""
    import json

    import jsonschema

    _gemma4_only(gemma_worker)
    sdk, name = gemma_worker.client(), "tiny-gemma4"
    ask = dict(
        model=name,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    whole = sdk.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    call = whole.message.tool_calls[0].function
    jsonschema.validate(json.loads(call.arguments), CITY_ARG)
    names, arguments, finish = [], "", None
    for chunk in sdk.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (names, arguments, finish) == (["get_weather"], call.arguments, "tool_calls")


def test_gemma4_a_second_turn_renders_the_call_and_its_result(gemma_worker: LocalWorker, tokenizer) -> None:
    _gemma4_only(gemma_worker)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0123456789abcdef01234567",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "21 C, sunny"},
    ]
    answer = gemma_worker.client().chat.completions.create(
        model="tiny-gemma4",
        messages=history,
        tools=[WEATHER],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    prompt = _prompt(tokenizer, answer)
    assert '<|tool>declaration:get_weather{description:<|"|>The weather in a city.<|"|>' in prompt
    # The result closes the model's turn-so-far; the answer continues that turn (no generation prompt is added).
    assert prompt.endswith(
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>21 C, sunny<|"|>}<tool_response|>'
    )
    assert answer.choices[0].finish_reason == "length"


def test_gemma4_enable_thinking_leaves_the_thought_channel_to_the_model(gemma_worker: LocalWorker, tokenizer) -> None:
    """Thinking off (the default), the template closes an empty thought channel after `<|turn>model`; on, it puts
    `<|think|>` in the system turn and leaves the channel for the model to open (then a forced call may follow its
    thinking)."""
    _gemma4_only(gemma_worker)
    sdk = gemma_worker.client()
    ask = dict(model="tiny-gemma4", messages=PROMPT, max_tokens=4, temperature=0)
    off = sdk.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    assert _prompt(tokenizer, off).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    on = sdk.chat.completions.create(
        **ask, extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": True}}
    )
    thinking = _prompt(tokenizer, on)
    assert "<|turn>system\n<|think|>\n" in thinking and thinking.endswith("<|turn>model\n")
    forced = sdk.chat.completions.create(
        **{**ask, "max_tokens": 160},
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = forced.choices[0].message
    assert forced.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
    assert "<|channel>" not in (message.content or "") and "<channel|>" not in (
        (message.model_extra or {}).get("reasoning_content") or ""
    )
