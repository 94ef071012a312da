"""TENSOR_PARALLEL_SIZE=2 through `handler.py --serve` on the CPU (two processes, gloo): a tiny random Llama on
SmolLM2's tokenizer answers the official openai client (chat, the same answer streamed, n=2, a forced tool call, a
LoRA adapter from LORA_MODULES and one loaded while serving, each answering as transformers does on its merged
weights); SIGTERM ends the worker and its rank; a killed rank makes the worker exit non-zero on its own."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_worker import ENDPOINT, start_worker, stop_worker

from engine.model.adapters import projection_shapes
from tests.lora_adapters import ALL_TARGETS, merge_into, write_adapter

ROOT = Path(__file__).resolve().parents[2]
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
# name -> (targets, whether LORA_MODULES names it at start; the other is loaded while serving)
ADAPTERS = {"sql": (ALL_TARGETS, True), "poet": (["q_proj", "v_proj", "o_proj", "down_proj"], False)}


def rank_pids(pid: int) -> list[int]:
    """The worker's tensor-parallel rank processes (spawned children; not multiprocessing's resource tracker)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in command:
            out.append(int(entry))
    return out


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: list[int], within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tp_model(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import transformers as tf

    root = tmp_path_factory.mktemp("tp-serving")
    source = root / "source"
    tokenizer = tf.AutoTokenizer.from_pretrained(str(baked_model_path))
    tokenizer.save_pretrained(str(source))
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
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
    return root / "model"


@pytest.fixture(scope="module")
def tp_adapters(tp_model: Path) -> dict[str, tuple[Path, dict]]:
    """Random LoRA adapters of the tiny model: name -> (folder, tensors by PEFT key), rank 4, alpha 8."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(str(tp_model))
    out = {}
    for seed, (name, (targets, _)) in enumerate(ADAPTERS.items()):
        folder = tp_model.parent / "adapters" / name
        tensors = write_adapter(
            folder, projection_shapes(config), config.num_hidden_layers, targets=targets, seed=seed, std=0.1
        )
        out[name] = (folder, tensors)
    return out


@pytest.fixture(scope="module")
def tp_worker(tp_model: Path, tp_adapters: dict, tmp_path_factory: pytest.TempPathFactory):
    at_start = " ".join(f"{name}={tp_adapters[name][0]}" for name, (_, start) in ADAPTERS.items() if start)
    worker = start_worker(
        tp_model,
        tmp_path_factory.mktemp("tp-worker") / "worker.log",
        TENSOR_PARALLEL_SIZE="2",
        LORA_MODULES=at_start,
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="true",
        MAX_LORAS="2",
        MAX_LORA_RANK="8",
    )
    yield worker
    stop_worker(worker)


def test_chat_stream_and_n_at_two_ranks(tp_worker):
    assert len(rank_pids(tp_worker.process.pid)) == 1
    assert "tensor_parallel=2" in tp_worker.log.read_text()
    client = tp_worker.client()
    name = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=name, messages=ask, max_tokens=12, temperature=0)
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=name, messages=ask, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content  # the same greedy answer, whole or streamed
    two = client.chat.completions.create(model=name, messages=ask, max_tokens=8, n=2, temperature=0.9, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content is not None for c in two.choices)


def test_a_forced_tool_call_at_two_ranks(tp_worker):
    client = tp_worker.client()
    name = client.models.list().data[0].id
    forced = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "The time in Tokyo?"}],
        tools=[TIME],
        tool_choice=forced,
        max_tokens=64,
        temperature=0,
    )
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["timezone"] in ("UTC", "CET", "JST")


def test_lora_adapters_at_start_and_loaded_while_serving_answer_as_transformers_merged(
    tp_worker, tp_model, tp_adapters
):
    import torch
    import transformers as tf

    client = tp_worker.client()
    base = client.models.list().data[0].id
    assert [m.id for m in client.models.list().data] == [base, "sql"]
    with tp_worker.http() as http:
        loaded = http.post(
            f"{ENDPOINT}/openai/v1/load_lora_adapter",
            json={"lora_name": "poet", "lora_path": str(tp_adapters["poet"][0])},
        )
    assert loaded.status_code == 200, loaded.text
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tp_model.parent / "source"), dtype=torch.float32).eval()
    ask = [{"role": "user", "content": "Name a colour."}]
    answers = {}
    for model in (base, "sql", "poet"):
        reply = client.chat.completions.create(
            model=model,
            messages=ask,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert reply.model == model
        answers[model] = got = reply.choices[0].model_extra["token_ids"]
        prompt = reply.model_extra["prompt_token_ids"]
        reference = hf
        if model != base:
            reference = copy.deepcopy(hf)
            merge_into(reference, tp_adapters[model][1], 8.0 / 4)
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert got == expected, model
    assert len({tuple(t) for t in answers.values()}) == 3  # each adapter changes the answer


def test_sigterm_leaves_no_rank_behind(tp_model: Path, tmp_path: Path):
    worker = start_worker(tp_model, tmp_path / "worker.log", TENSOR_PARALLEL_SIZE="2")
    ranks = rank_pids(worker.process.pid)
    assert len(ranks) == 1
    worker.process.send_signal(signal.SIGTERM)
    worker.process.wait(timeout=60)
    assert wait_gone(ranks), "a rank outlived the worker"


def test_a_killed_rank_makes_the_worker_exit_non_zero(tp_worker):
    ranks = rank_pids(tp_worker.process.pid)
    os.kill(ranks[0], signal.SIGKILL)
    assert tp_worker.process.wait(timeout=60) == 1
    assert "tensor-parallel rank 1" in tp_worker.log.read_text()
