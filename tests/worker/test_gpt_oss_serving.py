"""A tiny random-weight gpt-oss with MXFP4 experts and gpt-oss's real tokenizer (o200k, harmony_vocab.py), baked
from a local hub-layout folder by `python -m builder` and served by `handler.py --serve`, answers the official
openai client in the harmony format: chat whole and streamed, a named tool call, the Responses API with a
function tool, reasoning_effort. Random weights write random text, so the tests assert on the structure: no
harmony markup in any content, the call parsed with JSON arguments, the finish reasons."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from harmony_vocab import o200k_folder
from local_worker import start_worker, stop_worker

from worker.openai.harmony.encoding import harmony_encoding

ROOT = Path(__file__).resolve().parents[2]
EOS = [200002, 199999, 200012]  # <|return|>, <|endoftext|>, <|call|>
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MARKUP = ("<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|constrain|>")


@pytest.fixture(scope="module")
def gpt_oss_worker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    sys.path.insert(0, str(ROOT))
    from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss

    vocab = o200k_folder(Path(request.config.cache.mkdir("harmony-o200k")))
    root = tmp_path_factory.mktemp("gpt-oss-serving")
    source = root / "source"
    source.mkdir()
    build_gpt_oss(
        source, "mxfp4", vocab_size=201088, max_position_embeddings=4096, eos_token_id=EOS, pad_token_id=199999
    )
    shutil.copy(vocab / "tokenizer.json", source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
            }
        )
    )
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "pad_token_id": 199999}))
    baked = subprocess.run(
        [sys.executable, "-m", "builder", "--model", str(source), "--out", str(root / "model")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert baked.returncode == 0, baked.stderr
    worker = start_worker(root / "model", root / "worker.log")
    yield worker
    stop_worker(worker)


def _clean(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


def test_chat_whole_and_streamed(gpt_oss_worker):
    client = gpt_oss_worker.client()
    name = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=name, messages=ask, max_tokens=16, temperature=0, seed=1)
    choice = whole.choices[0]
    assert whole.usage.completion_tokens > 0 and choice.finish_reason in ("length", "stop")
    reasoning = getattr(choice.message, "reasoning_content", None) or (choice.message.model_extra or {}).get(
        "reasoning_content"
    )
    _clean(choice.message.content)
    _clean(reasoning)
    stream = client.chat.completions.create(model=name, messages=ask, max_tokens=16, temperature=0, seed=1, stream=True)
    content, thought, finish = [], [], None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            thought.append((delta.model_extra or {}).get("reasoning_content") or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(content) == (choice.message.content or "") and finish == choice.finish_reason
    assert "".join(thought) == (reasoning or "")

    for effort in ("low", "high"):  # accepted, and rendered into the system message (the prompt grows or not)
        answer = client.chat.completions.create(
            model=name, messages=ask, max_tokens=4, temperature=0, reasoning_effort=effort
        )
        assert answer.usage.prompt_tokens > 0


def test_named_tool_call_whole_and_streamed(gpt_oss_worker):
    client = gpt_oss_worker.client()
    name = client.models.list().data[0].id
    ask = dict(
        model=name,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,  # random weights would otherwise pad the JSON with whitespace
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    call = client.chat.completions.create(**ask)
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER["function"]["parameters"])
    _clean(choice.message.content)

    arguments, names, finish = [], [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            for delta in chunk.choices[0].delta.tool_calls or []:
                names += [delta.function.name] if delta.function and delta.function.name else []
                arguments.append(delta.function.arguments or "" if delta.function else "")
            finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert json.loads("".join(arguments)) == json.loads(tool_call.function.arguments)


def test_responses_with_a_function_tool(gpt_oss_worker):
    client = gpt_oss_worker.client()
    name = client.models.list().data[0].id
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": WEATHER["function"]["parameters"],
    }
    response = client.responses.create(
        model=name,
        input="Weather in Rome?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        reasoning={"effort": "low"},
        max_output_tokens=64,
        temperature=0,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and [c.name for c in calls] == ["get_weather"], response.output
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])

    with client.responses.stream(model=name, input="Hello", max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    # Cut at max_output_tokens, the stream ends with response.incomplete (get_final_response wants completed).
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    for item in final.output:
        assert item.type in ("reasoning", "message", "function_call")
        if item.type == "message":
            _clean("".join(part.text for part in item.content if part.type == "output_text"))


def test_native_job_with_tools_is_refused(gpt_oss_worker):
    with gpt_oss_worker.http() as http:
        job = {
            "input": {
                "messages": [{"role": "user", "content": "Weather?"}],
                "tools": [WEATHER],
                "sampling_params": {"max_tokens": 8},
            }
        }
        reply = http.post("/v2/e/runsync", json=job).json()
    assert reply["status"] == "FAILED", reply
    assert reply["error"]["param"] == "tools" and "harmony" in reply["error"]["message"]


TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": WEATHER["function"]["parameters"],
}


def _thought(text: str) -> dict:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _harmony_prompt(vocab: Path, turns: list) -> list[int]:
    """openai-harmony's own render of `turns` (its Message objects) after the system and developer messages the
    worker writes for TOOL with no reasoning effort, today's date."""
    import datetime

    from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent, ToolDescription

    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    tools = DeveloperContent.new().with_function_tools(
        [ToolDescription.new(TOOL["name"], TOOL["description"], TOOL["parameters"])]
    )
    conv = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system),
            Message.from_role_and_content(Role.DEVELOPER, tools),
            *turns,
        ]
    )
    return list(harmony_encoding(str(vocab)).render_conversation_for_completion(conv, Role.ASSISTANT))


def _turns(items: list[dict]) -> list:
    """The harmony messages gpt-oss wrote or read for these Responses items."""
    from openai_harmony import Author, Message, Role

    out, names = [], {}
    for item in items:
        if item["type"] == "message":
            role = Role.USER if item["role"] == "user" else Role.ASSISTANT
            text = item["content"] if isinstance(item["content"], str) else item["content"][0]["text"]
            out.append(
                Message.from_role_and_content(role, text).with_channel("final")
                if role == Role.ASSISTANT
                else Message.from_role_and_content(role, text)
            )
        elif item["type"] == "reasoning":
            out.append(
                Message.from_role_and_content(Role.ASSISTANT, item["content"][0]["text"]).with_channel("analysis")
            )
        elif item["type"] == "function_call":
            names[item["call_id"]] = item["name"]
            out.append(
                Message.from_role_and_content(Role.ASSISTANT, item["arguments"])
                .with_channel("commentary")
                .with_recipient(f"functions.{item['name']}")
                .with_content_type("<|constrain|>json")
            )
        else:
            author = Author.new(Role.TOOL, f"functions.{names[item['call_id']]}")
            out.append(
                Message.from_author_and_content(author, item["output"])
                .with_channel("commentary")
                .with_recipient("assistant")
            )
    return out


def _ask(client, name: str, **fields):
    """A Responses request that gives back its prompt's token ids (vLLM's return_token_ids)."""
    fields.setdefault("tool_choice", "auto")
    fields.setdefault("max_output_tokens", 2)
    extra = {"return_token_ids": True, **fields.pop("extra_body", {})}
    response = client.responses.create(model=name, tools=[TOOL], temperature=0, extra_body=extra, **fields)
    return response, response.model_extra["prompt_token_ids"]


def test_replayed_items_render_as_openai_harmony_renders_them(gpt_oss_worker, request: pytest.FixtureRequest):
    vocab = o200k_folder(Path(request.config.cache.mkdir("harmony-o200k")))
    client = gpt_oss_worker.client()
    name = client.models.list().data[0].id
    items = [
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        _thought("first thought: call the tool"),
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        _thought("second thought: answer"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"type": "message", "role": "user", "content": "And Rome?"},
        _thought("third thought: call again"),
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_2", "output": "rainy"},
    ]
    decode = harmony_encoding(str(vocab)).decode
    # After a final answer, the next user turn's prompt drops the reasoning that led to it.
    _, ids = _ask(client, name, input=items[:7])
    assert ids == _harmony_prompt(vocab, _turns(items[:7]))
    text = decode(ids)
    assert "first thought" not in text and "second thought" not in text
    assert "<|channel|>final<|message|>Sunny.<|end|><|start|>user<|message|>And Rome?<|end|>" in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    # In a turn still calling tools its reasoning stays. openai-harmony drops analysis only when the last
    # assistant message is a final answer, so mid-turn it keeps the earlier turns' reasoning too.
    _, ids = _ask(client, name, input=items)
    assert ids == _harmony_prompt(vocab, _turns(items))
    text = decode(ids)
    assert "<|start|>assistant<|channel|>analysis<|message|>third thought: call again<|end|>" in text
    assert text.count("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>") == 2
    assert text.endswith("rainy<|end|><|start|>assistant")


def test_previous_response_id_renders_the_same_prompt_as_replayed_items(gpt_oss_worker, request: pytest.FixtureRequest):
    vocab = o200k_folder(Path(request.config.cache.mkdir("harmony-o200k")))
    client = gpt_oss_worker.client()
    name = client.models.list().data[0].id
    opening = [
        {"type": "message", "role": "user", "content": "Hi"},
        _thought("greet back"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": "Weather in Rome?"},
        _thought("use the tool"),
    ]
    # The call is forced, so random weights still give a function_call item (its arguments held to the schema).
    first, _ = _ask(
        client,
        name,
        input=opening,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "rainy"}
    chained, chained_ids = _ask(client, name, previous_response_id=first.id, input=[result])
    replayed = [*opening, call.model_dump(exclude_none=True), result]
    _, replayed_ids = _ask(client, name, input=replayed)
    assert chained_ids == replayed_ids == _harmony_prompt(vocab, _turns(replayed))
    assert chained.previous_response_id == first.id
    text = harmony_encoding(str(vocab)).decode(chained_ids)
    assert "<|start|>assistant<|channel|>analysis<|message|>use the tool<|end|>" in text
    assert f"<|message|>{call.arguments}<|call|>" in text or f"<|message|>{call.arguments}<|end|>" in text


def test_a_text_format_schema_holds_the_final_answer(gpt_oss_worker):
    client = gpt_oss_worker.client()
    name = client.models.list().data[0].id
    schema = WEATHER["function"]["parameters"]
    response = client.responses.create(
        model=name,
        input="Weather?",
        max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    [message] = response.output
    assert message.type == "message" and response.status == "completed", response.output
    jsonschema.validate(json.loads(message.content[0].text), schema)
