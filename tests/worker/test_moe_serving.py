"""A tiny random-weight Qwen3-MoE, baked from a local hub-layout folder by `python -m builder` and served by
`handler.py --serve`, answers the official openai client: chat, the same answer streamed, n=2, a forced tool
call (hermes, the Qwen3 template) and a JSON schema, valid whatever its random weights prefer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from family_templates import QWEN3
from local_worker import start_worker, stop_worker

ROOT = Path(__file__).resolve().parents[2]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Oslo", "Lima"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "rank"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def moe_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    import torch
    import transformers as tf
    from tokenizers import AddedToken

    root = tmp_path_factory.mktemp("qwen3-moe-serving")
    source = root / "source"
    tokenizer = tf.AutoTokenizer.from_pretrained(str(baked_model_path))
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")]
    )
    tokenizer.chat_template = QWEN3
    tokenizer.save_pretrained(str(source))
    config = tf.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(source))
    baked = subprocess.run(
        [sys.executable, "-m", "builder", "--model", str(source), "--out", str(root / "model")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert baked.returncode == 0, baked.stderr
    worker = start_worker(root / "model", root / "worker.log")
    yield worker
    stop_worker(worker)


def test_chat_stream_tool_call_and_schema(moe_worker):
    client = moe_worker.client()
    name = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=name, messages=ask, max_tokens=12, temperature=0, seed=1)
    assert whole.usage.completion_tokens > 0 and whole.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(model=name, messages=ask, max_tokens=12, temperature=0, seed=1, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content  # the same greedy answer, whole or streamed

    two = client.chat.completions.create(model=name, messages=ask, max_tokens=8, n=2, temperature=0.9, seed=3)
    assert [c.index for c in two.choices] == [0, 1]

    call = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    calls = call.choices[0].message.tool_calls
    assert call.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    answer = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "A city?"}],
        response_format=fmt,
        max_tokens=64,
        temperature=0,
        # random weights would otherwise pad the JSON with whitespace
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY)
