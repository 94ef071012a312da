"""The official `openai` npm package against the local endpoint (js/check.mjs): models, chat, streamed chat,
through RunPod's URL layout and API key, as a JavaScript user calls the hosted endpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "js"
NETWORK_ERRORS = re.compile(r"ENOTFOUND|EAI_AGAIN|ETIMEDOUT|ECONNREFUSED|ECONNRESET|network", re.I)


@pytest.fixture(scope="module")
def node_with_openai() -> str:
    """The node binary, with js/node_modules installed from the lock file when missing."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm are not installed")
    if not (JS / "node_modules" / "openai" / "package.json").is_file():
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=JS, capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            if NETWORK_ERRORS.search(result.stderr):
                pytest.skip(f"npm ci could not reach the registry: {result.stderr.strip().splitlines()[-1]}")
            pytest.fail(f"npm ci failed:\n{result.stderr}")
    pinned = json.loads((JS / "package.json").read_text())["dependencies"]["openai"]
    installed = json.loads((JS / "node_modules" / "openai" / "package.json").read_text())["version"]
    assert installed == pinned, f"js/node_modules has openai {installed}, package.json pins {pinned}: run npm ci"
    return node


def run_check(node: str, base_url: str, api_key: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "RUNPOD_", "CHECK_"))}
    env["RUNPOD_API_KEY"] = api_key
    return subprocess.run([node, "check.mjs", base_url], cwd=JS, env=env, capture_output=True, text=True, timeout=300)


def test_openai_npm_client_chats_streams_and_lists_models(node_with_openai: str, local_endpoint: Any) -> None:
    result = run_check(node_with_openai, f"{local_endpoint.url}/v2/local-endpoint/openai/v1", local_endpoint.api_key)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    served = local_endpoint.served_model_name
    assert report["models"] == [served] and report["model"] == served
    chat = report["chat"]
    assert chat["object"] == "chat.completion" and chat["model"] == served and chat["role"] == "assistant"
    assert chat["content"].strip() and chat["finish_reason"] in ("stop", "length")
    assert 0 < chat["usage"]["completion_tokens"] <= 24
    stream = report["stream"]
    assert stream["content"] == chat["content"], "temperature 0: the stream must spell the same text"
    assert stream["roles"] == ["assistant"] and len(stream["ids"]) == 1 and stream["chunks"] >= 3
    assert stream["finish_reason"] == chat["finish_reason"]
    assert stream["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]
    response, events = report["response"], report["response_stream"]
    assert response["object"] == "response" and response["model"] == served and response["id"].startswith("resp_")
    assert response["output_text"] == chat["content"] and events["text"] == chat["content"]
    assert response["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert events["first"] == "response.created" and events["last"] == f"response.{events['status']}"
    assert events["in_order"] and events["status"] == response["status"]


def test_openai_npm_client_is_refused_with_a_wrong_key(node_with_openai: str, local_endpoint: Any) -> None:
    result = run_check(node_with_openai, f"{local_endpoint.url}/openai/v1", "not-the-key")
    assert result.returncode == 1
    assert "401" in result.stderr
