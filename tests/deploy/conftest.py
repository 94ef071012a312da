"""Fixtures for the deployment files: the docs generator (which also parses the Dockerfile), a tiny model
to bake, and the local endpoint (`python handler.py --serve`) running the baked default model."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "deploy-test-key"


def load_generator() -> ModuleType:
    """docs/gen_configuration.py as a module (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_configuration", ROOT / "docs" / "gen_configuration.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gen() -> ModuleType:
    return load_generator()


@pytest.fixture(scope="session")
def dockerfile(gen: ModuleType) -> list:
    return gen.parse_dockerfile((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, baked_model_path: Path) -> Path:
    """A random-weight two-layer Llama with the default model's tokenizer: a hub-shaped folder to bake."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (baked_model_path / name).is_file():
            shutil.copy(baked_model_path / name, folder / name)
    return folder


@dataclass
class LocalEndpoint:
    """The running local endpoint: its root URL, the key it requires and the name it serves."""

    url: str
    api_key: str
    served_model_name: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def local_endpoint(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEndpoint]:
    """`python handler.py --serve` on a free loopback port with an API key, as a user starts it."""
    if not (ROOT / "handler.py").is_file():
        pytest.fail("handler.py does not exist yet")
    from builder.sources import DEFAULT_MODEL_NAME
    from worker.settings import Settings

    port = free_port()
    log = tmp_path_factory.mktemp("endpoint") / "server.log"
    # The worker's own variables from the caller's shell would change what it serves: start from defaults.
    aliases = {field.alias for field in Settings.model_fields.values()}
    env = {k: v for k, v in os.environ.items() if k not in aliases}
    # .runpod/tests.json names the model a default image serves (the Hub builds with default build args);
    # a bake made outside `make` may carry another name, so the endpoint serves under that one.
    env.update(
        MODEL_PATH=str(baked_model_path),
        RUNPOD_API_KEY=API_KEY,
        PYTHONUNBUFFERED="1",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE=DEFAULT_MODEL_NAME,
    )
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-u", "handler.py", "--serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the local endpoint exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the local endpoint did not answer /health in 180 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield LocalEndpoint(url, API_KEY, DEFAULT_MODEL_NAME)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
