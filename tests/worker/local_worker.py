"""A local worker for tests: `handler.py --serve` as a subprocess on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
ENDPOINT = "/v2/test-endpoint"
# Variables a developer's shell may carry that would change what the tests expect.
CLEARED = (
    "RUNPOD_API_KEY",
    "RUNPOD_WEBHOOK_GET_JOB",
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE",
    "OPENAI_RESPONSE_ROLE",
    "RAW_OPENAI_OUTPUT",
    "MODEL_NAME",
    "CUSTOM_CHAT_TEMPLATE",
    "MAX_MODEL_LEN",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MIN_BATCH_SIZE",
    "DEFAULT_BATCH_SIZE_GROWTH_FACTOR",
    "DEVICE",
    "DTYPE",
    "ATTENTION_BACKEND",
    "QUANTIZATION",
    "VERIFY_MODEL_SHA256",
    "RESPONSE_STORE_URL",
    "ENDPOINT_TYPE",
    "PORT",
    "PORT_HEALTH",
)
MAX_MODEL_LEN = 2048


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(model_path: Path, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    # float32: tests compare answers given side by side with the same answers given alone, and only float32
    # is batch-invariant on CPU (DTYPE=auto picks bfloat16 on CPUs with bfloat16 instructions, where a row's
    # result depends on its batch; bench/RESULTS.md).
    env.update(MODEL_PATH=str(model_path), MAX_MODEL_LEN=str(MAX_MODEL_LEN), PYTHONUNBUFFERED="1", DTYPE="float32")
    env.update(overrides)
    return env


@dataclass
class LocalWorker:
    """A running `handler.py --serve`."""

    base: str
    process: subprocess.Popen
    log: Path
    api_key: str = "unused"

    def url(self, path: str) -> str:
        return self.base + path

    @property
    def openai_url(self) -> str:
        return self.url(f"{ENDPOINT}/openai/v1")

    def client(self, timeout: float = 120, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.openai_url, api_key=self.api_key, max_retries=0, timeout=timeout, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=120, headers={"Authorization": f"Bearer {self.api_key}"})


def start_worker(model_path: Path, log: Path, **env: str) -> LocalWorker:
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "handler.py"), "--serve", "--port", str(port)],
            cwd=ROOT,
            env=worker_env(model_path, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    worker = LocalWorker(f"http://127.0.0.1:{port}", process, log, env.get("RUNPOD_API_KEY", "unused"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(worker.url("/health"), timeout=2).status_code == 200:
                return worker
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"the worker did not come up:\n{log.read_text()[-3000:]}")


def stop_worker(worker: LocalWorker) -> None:
    worker.process.terminate()
    try:
        worker.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        worker.process.kill()
