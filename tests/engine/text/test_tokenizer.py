"""engine.text.tokenizer against transformers: the same token ids, text and rendered chat templates.

The worker runs the tokenizer and chat templates without transformers (a second of cold start), so every
result here is compared with what transformers' AutoTokenizer gives on the same folder: generated texts,
id sequences and conversations (with tools, reasoning, prefill) through the baked model's template and the
family templates the tool-call tests use.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2 import TemplateError

from engine.text.tokenizer import Tokenizer, load_tokenizer
from tests.worker import family_templates as family

CHECK = settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
TEMPLATES = {
    "qwen2.5": family.QWEN25,
    "qwen3": family.QWEN3,
    "llama3.1": family.LLAMA31,
    "mistral-v0.3": family.MISTRAL_V3,
    "deepseek-r1": family.DEEPSEEK_R1,
    # What the message dicts hold once prepared: reasoning under its aliases, None-valued keys gone.
    "fields": "{% for m in messages %}{{ m | tojson }}{{ m.thinking is defined }}\n{% endfor %}",
}


@pytest.fixture(scope="module")
def pair(baked_model_path):
    from transformers import AutoTokenizer

    ours = load_tokenizer(str(baked_model_path))
    assert isinstance(ours, Tokenizer)
    return ours, AutoTokenizer.from_pretrained(baked_model_path)


def _texts():
    pieces = st.sampled_from(
        [
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            " ",
            "\n",
            "  ",
            "é",
            "日本",
            "🙂",
            "Hello",
            " world",
            "\t",
            "'s",
            " ?",
            "<think>",
            '{"a": 1}',
        ]
    )
    return st.lists(st.one_of(pieces, st.text(max_size=12)), max_size=12).map("".join)


@CHECK
@given(text=_texts(), special=st.booleans())
def test_encode_matches(pair, text, special):
    ours, ref = pair
    assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)


@CHECK
@given(ids=st.lists(st.integers(0, 49151), max_size=24), skip=st.booleans(), clean=st.sampled_from([None, False]))
def test_decode_matches(pair, ids, skip, clean):
    ours, ref = pair
    assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == ref.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean
    )
    tokens = ref.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids) == tokens
    assert ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens) == ids


def test_vocabulary_and_special_tokens_match(pair):
    ours, ref = pair
    assert ours.get_vocab() == ref.get_vocab()
    assert len(ours) == len(ref)
    assert ours.all_special_ids == ref.all_special_ids and ours.all_special_tokens == ref.all_special_tokens
    assert ours.special_tokens_map == ref.special_tokens_map
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        assert (getattr(ours, name), getattr(ours, f"{name}_id")) == (getattr(ref, name), getattr(ref, f"{name}_id"))
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in ref.added_tokens_decoder.items()
    }
    assert ours.added_tokens_encoder == ref.added_tokens_encoder
    assert ours.chat_template == ref.chat_template


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@st.composite
def conversations(draw):
    text = _texts()
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(text)})
    for turn in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(text)})
        if draw(st.booleans()):
            answer = {"role": "assistant", "content": draw(text)}
            if draw(st.booleans()):
                answer["reasoning_content"] = draw(text)
            if draw(st.booleans()):
                call_id = f"call{turn:04d}a"  # 9 characters, as Mistral wants
                answer["tool_calls"] = [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": draw(text)}},
                    }
                ]
                messages.append(answer)
                answer = {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": "get_weather",
                    "content": json.dumps({"temp": draw(st.integers(-40, 40))}),
                }
            messages.append(answer)
    prefill = messages[-1]["role"] == "assistant" and draw(st.booleans())
    return messages, prefill


@pytest.mark.parametrize("name", ["baked", *TEMPLATES])
def test_chat_templates_render_the_same(pair, name):
    ours, ref = pair
    template = None if name == "baked" else TEMPLATES[name]

    @CHECK
    @given(case=conversations(), tools=st.sampled_from([None, [TOOL]]), thinking=st.booleans())
    def check(case, tools, thinking):
        messages, prefill = case
        kwargs = dict(
            chat_template=template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
            enable_thinking=thinking,
        )
        try:
            expected = ref.apply_chat_template(messages, **kwargs)
        except (TemplateError, ValueError):  # the template refused (e.g. roles out of order): ours must too
            with pytest.raises((TemplateError, ValueError)):
                ours.apply_chat_template(messages, **kwargs)
            return
        assert ours.apply_chat_template(messages, **kwargs) == expected

    check()


def test_a_rebuilt_post_processor_is_what_the_bake_saves(tmp_path, baked_model_path):
    # add_bos_token in tokenizer_config makes transformers rebuild the post-processor when it loads; saved
    # back (as the bake does), tokenizer.json carries it, and ours adds the same BOS.
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(baked_model_path, add_bos_token=True)
    ref.save_pretrained(tmp_path)
    ours = Tokenizer.from_folder(tmp_path)
    assert ours.encode("Hi there") == ref.encode("Hi there") == [ref.bos_token_id, *ref.encode("Hi there")[1:]]
    assert ours.encode("Hi there")[0] == ours.bos_token_id


def test_named_templates_pick_the_default_or_tool_use(tmp_path, baked_model_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(baked_model_path)
    ref.chat_template = {"default": "D{{ messages[0]['content'] }}", "tool_use": "T{{ tools | length }}"}
    ref.save_pretrained(tmp_path)
    ref = AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_folder(tmp_path)
    chat = [{"role": "user", "content": "x"}]
    for kwargs in ({}, {"tools": [TOOL]}, {"chat_template": "tool_use", "tools": []}):
        assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == ref.apply_chat_template(
            chat, tokenize=False, **kwargs
        )
    assert ours.apply_chat_template(chat, tokenize=False) == "Dx"


def test_the_sandbox_holds(pair):
    ours, _ = pair
    for template in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}{{ ns }}"):
        with pytest.raises(Exception, match="unsafe|underscore|access"):
            ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template, tokenize=False)


def test_loading_needs_no_transformers(baked_model_path):
    import subprocess
    import sys

    code = (
        "import sys; from engine.text.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
        "t.apply_chat_template([{'role': 'user', 'content': 'x'}], tokenize=False); "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(baked_model_path)], check=True)


def test_only_a_bake_is_read_without_transformers(tmp_path, baked_model_path):
    # transformers picks its tokenizer class by config.json's model_type: a Qwen2 config over this
    # tokenizer.json gets Qwen2's own pre-tokenizer ("\n\n" is one token, not two). The file as it lies does
    # not say so; the bake saves what transformers runs, so only a bake is read by ours.
    import shutil

    from transformers import AutoTokenizer

    from builder.bake import bake
    from builder.sources import resolve
    from tests.engine.conftest import build_tiny_checkpoint

    source = tmp_path / "source"
    build_tiny_checkpoint("qwen2", source)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(baked_model_path / name, source / name)
    text = "a\n\nb"
    ref = AutoTokenizer.from_pretrained(source)
    assert Tokenizer.from_folder(source).encode(text) != ref.encode(text)
    assert type(load_tokenizer(str(source))) is type(ref)  # not a bake: transformers' own
    bake(resolve(str(source), None), tmp_path / "model")
    ours = load_tokenizer(str(tmp_path / "model"))
    assert isinstance(ours, Tokenizer) and ours.encode(text) == ref.encode(text)
