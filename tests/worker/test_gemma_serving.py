"""A tiny random Gemma 2 baked by the builder from a hub-layout folder (the default model's tokenizer, a vocabulary
to match, Gemma 2's chat template) serves chat through the local endpoint with the official SDK: whole and
streamed answers agree, and the template's own refusal of a system turn is a 400 that says so."""

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
PROMPT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def gemma_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    import transformers as tf

    root = tmp_path_factory.mktemp("gemma2-bake")
    source = root / "tiny-gemma2"
    config = tf.Gemma2Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                             sliding_window=16, max_position_embeddings=512)
    torch.manual_seed(0)
    tf.Gemma2ForCausalLM(config).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(baked_model_path / name, source / name)
    (source / "chat_template.jinja").write_text(GEMMA2_TEMPLATE)
    out = root / "model"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    baked = subprocess.run([sys.executable, "-m", "builder", "--model", str(source), "--out", str(out)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    assert baked.returncode == 0, baked.stderr
    w = start_worker(out, root / "worker.log", MAX_MODEL_LEN="512")
    yield w
    stop_worker(w)


def test_chat_whole_and_streamed_agree(gemma_worker: LocalWorker) -> None:
    sdk = gemma_worker.client()
    whole = sdk.chat.completions.create(model="tiny-gemma2", messages=PROMPT, temperature=0, max_tokens=12)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    text = whole.choices[0].message.content
    assert text
    stream = sdk.chat.completions.create(model="tiny-gemma2", messages=PROMPT, temperature=0, max_tokens=12,
                                         stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_a_system_turn_is_the_templates_400(gemma_worker: LocalWorker) -> None:
    sdk = gemma_worker.client()
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="tiny-gemma2", max_tokens=4,
                                    messages=[{"role": "system", "content": "Be brief."}, *PROMPT])
    assert "System role not supported" in str(info.value)
