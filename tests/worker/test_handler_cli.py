"""`python handler.py --test_input` really runs the async generator job, as a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from local_worker import ROOT, worker_env
from openai_schema import parse_sse, validate

Q = [{"role": "user", "content": "What is the capital of France?"}]


def run_cli(model_path, *args: str, **env: str) -> tuple[int, list[dict], str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "handler.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=worker_env(model_path, **env),
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines, done.stderr


def test_test_input_streams_and_aggregates_like_runsync(baked_model_path, client, model_name) -> None:
    body = {"model": model_name, "messages": Q, "max_tokens": 8, "temperature": 0}
    job = {"openai_route": "/v1/chat/completions", "openai_input": {**body, "stream": True}}
    code, lines, stderr = run_cli(baked_model_path, "--test_input", json.dumps(job))
    assert code == 0, stderr
    *outputs, aggregate = lines
    assert aggregate["status"] == "COMPLETED" and aggregate["output"] == [o["output"] for o in outputs]
    assert len(outputs) > 1  # each yield printed as it came
    events = [validate(e) for e in parse_sse("".join(aggregate["output"]))]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == client.chat.completions.create(**body).choices[0].message.content
    assert "serving model=" in stderr and "first output" in stderr  # the start-up line and the cold-start figure
    phases = re.search(r"start-up in ms: (.*); ready ([\d.]+) s after the process started", stderr)
    assert phases, stderr
    named = dict(p.rsplit(" ", 1) for p in phases.group(1).split(", "))
    assert {"python", "settings", "imports", "weights", "tokenizer", "kv cache"} <= set(named)
    assert sum(int(ms) for ms in named.values()) <= 1000 * float(phases.group(2)) + 5


def test_test_input_json_is_the_default_and_errors_exit_non_zero(baked_model_path) -> None:
    code, lines, stderr = run_cli(baked_model_path)  # outside RunPod, no argument: test_input.json
    assert code == 0, stderr
    assert lines[-1]["status"] == "COMPLETED"
    assert all("choices" in o and "usage" in o for o in lines[-1]["output"])
    # RunPod's SDK takes the whole job, {"input": {...}}: the same job in that form gives the same answer.
    job = json.loads((ROOT / "test_input.json").read_text())
    code, wrapped, stderr = run_cli(baked_model_path, "--test_input", json.dumps(job))
    assert code == 0, stderr
    assert wrapped[-1]["status"] == "COMPLETED" and wrapped[-1]["output"] == lines[-1]["output"]
    bad_route = json.dumps({"openai_route": "/v1/nothing", "openai_input": {}})
    code, lines, _ = run_cli(baked_model_path, "--test_input", bad_route)
    assert code == 1 and lines[-1]["status"] == "FAILED" and lines[-1]["error"]["code"] == "unknown_url"


def test_bad_input_or_settings_stop_before_loading_the_model(baked_model_path) -> None:
    code, lines, stderr = run_cli(baked_model_path, "--test_input", "{not json")
    assert code == 2 and lines == [] and "bad test input" in stderr
    code, _, stderr = run_cli(baked_model_path, "--test_input", "{}", MAX_CONCURRENCY="many")
    assert code == 2 and stderr.strip().splitlines()[-1].startswith("error: environment variable MAX_CONCURRENCY=")


def test_a_missing_model_is_one_line_naming_the_folder(tmp_path) -> None:
    missing = tmp_path / "no-model-here"
    code, lines, stderr = run_cli(missing, "--test_input", "{}")
    last = stderr.strip().splitlines()[-1]
    assert code == 2 and lines == []
    assert last.startswith("error: no model at") and str(missing) in last and "python -m builder" in last
    assert "Traceback" not in stderr


def test_a_kv_cache_too_small_for_max_model_len_stops_start_up_saying_what_to_change(baked_model_path) -> None:
    code, lines, stderr = run_cli(
        baked_model_path, "--test_input", "{}", MAX_MODEL_LEN="2048", NUM_GPU_BLOCKS_OVERRIDE="4", BLOCK_SIZE="16"
    )
    assert code == 2 and lines == [] and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "error: the KV cache (4 pages of 16 tokens) cannot hold one sequence of MAX_MODEL_LEN=2048 tokens: "
        "lower MAX_MODEL_LEN to at most 64, or raise NUM_GPU_BLOCKS_OVERRIDE"
    )
