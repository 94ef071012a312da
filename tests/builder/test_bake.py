"""The baker: every source kind produces a runnable folder + manifest; every failure is one line, nothing left."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from builder.bake import MANIFEST, bake
from builder.sources import DEFAULT_GGUF_FILE, default_gguf_path, resolve
from engine.model.adapters import projection_shapes
from tests.lora_adapters import write_adapter

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def run_baker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "builder", *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, baked_model_path: Path) -> Path:
    """A random-weight two-layer Llama with the default model's tokenizer, saved as a HF folder."""
    return tiny_folder(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("tiny-llama"), baked_model_path, seed=0)


def tiny_folder(config_class: type, model_class: type, folder: Path, tokenizer_from: Path, seed: int) -> Path:
    """A random-weight two-layer model of `model_class` with the tokenizer files of `tokenizer_from`."""
    config = config_class(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model_class(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


def test_default_gguf_bake_generates_like_the_gguf_model(tmp_path: Path) -> None:
    out = tmp_path / "model"
    manifest = bake(resolve("", None), out)
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        MANIFEST,
    ]:
        assert (out / name).is_file(), name
    assert manifest["served_model_name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert set(manifest["files"]) >= {"model.safetensors", "tokenizer.json"}
    assert leftovers(tmp_path) == ["model"]

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    baked = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=DEFAULT_GGUF_FILE, dtype=torch.float32)
    got = baked.generate(ids, max_new_tokens=12, do_sample=False)
    want = reference.generate(ids, max_new_tokens=12, do_sample=False)
    assert got.tolist() == want.tolist()
    assert "Paris" in tok.decode(got[0, ids.shape[1] :])


def test_local_folder_source(tmp_path: Path, tiny_llama: Path) -> None:
    (tiny_llama / "README.md").write_text("not copied")
    out = tmp_path / "baked"
    result = run_baker("--model", str(tiny_llama), "--out", str(out), "--served-name", "tiny")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["served_model_name"] == "tiny"
    assert manifest["source"]["kind"] == "local" and manifest["source"]["ref"] == tiny_llama.name
    assert str(tiny_llama.parent) not in json.dumps(manifest)
    assert not (out / "README.md").exists()
    assert (out / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()
    tokenizers = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_llama)
    assert tokenizers[0].encode("hello") == tokenizers[1].encode("hello")
    # --if-missing leaves an existing bake of the same source alone
    again = run_baker("--model", str(tiny_llama), "--out", str(out), "--if-missing")
    assert again.returncode == 0 and "already baked" in again.stdout
    # ... but not a bake of an older format, whose tokenizer the worker cannot read without transformers
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest.pop("tokenizer_saved_by").startswith("transformers ")
    (out / "manifest.json").write_text(json.dumps(manifest))
    again = run_baker("--model", str(tiny_llama), "--out", str(out), "--if-missing")
    assert again.returncode == 0 and "already baked" not in again.stdout
    assert "tokenizer_saved_by" in json.loads((out / "manifest.json").read_text())


def test_bin_checkpoint_is_converted(tmp_path: Path, tiny_llama: Path) -> None:
    src = tmp_path / "bin-model"
    shutil.copytree(tiny_llama, src)
    model = LlamaForCausalLM.from_pretrained(src)
    (src / "model.safetensors").unlink()
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    out = tmp_path / "baked"
    bake(resolve(str(src), None), out)
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    reloaded = LlamaForCausalLM.from_pretrained(out)
    torch.testing.assert_close(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_hub_source_from_offline_cache(tmp_path: Path, tiny_llama: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(tiny_llama, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    out = tmp_path / "baked"
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "MODEL_NAME": "acme/tiny-llama"}
    result = run_baker("--out", str(out), env=env)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["served_model_name"] == "acme/tiny-llama"
    assert manifest["source"]["kind"] == "hub" and manifest["revision"] == commit
    # Another MODEL_REVISION is another model: --if-missing re-bakes it, then keeps it.
    other = "fedcba9876543210fedcba9876543210fedcba98"
    shutil.copytree(tiny_llama, repo_dir / "snapshots" / other)
    for expected in (
        f"re-baking {out}: it holds acme/tiny-llama (hub) at revision default, not {other}",
        f"model already baked in {out}",
    ):
        result = run_baker("--out", str(out), "--if-missing", env={**env, "MODEL_REVISION": other})
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0] == expected
        assert json.loads((out / MANIFEST).read_text())["revision"] == other


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers every hub API call the way huggingface.co does for one failure (set on the server)."""

    def do_GET(self) -> None:  # noqa: N802
        status, code = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "no"}')

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_hub():
    def start(status: int, code: str) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
        server.answer = (status, code)  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    servers: list = []
    yield start
    for server in servers:
        server.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "answer, token, message",
    [
        ((404, "RepoNotFound"), None, "acme/missing is not a model repository on the Hugging Face hub"),
        ((403, "GatedRepo"), None, "gated repository: accept its terms on the hub and set HF_TOKEN"),
        (None, None, "cannot reach the Hugging Face hub"),
    ],
    ids=["unknown-repo", "gated-no-token", "no-network"],
)
def test_hub_failures_are_one_clear_line(tmp_path: Path, fake_hub, answer, token, message) -> None:
    endpoint = fake_hub(*answer) if answer else f"http://127.0.0.1:{closed_port()}"
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_HUB_ETAG_TIMEOUT": "2",
        "HF_HUB_DOWNLOAD_TIMEOUT": "2",
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": "",
    }
    out_parent = tmp_path / "models"
    result = run_baker("--model", "acme/missing", "--out", str(out_parent / "model"), env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert leftovers(out_parent) == []


def test_folder_failures_leave_nothing(tmp_path: Path, tiny_llama: Path) -> None:
    cases = {
        "unsupported": ("config.json", "architecture GPT2LMHeadModel is not supported by the engine"),
        "no-weights": ("model.safetensors", "the model has no weights"),
        "no-tokenizer": ("tokenizer.json", "the model has no tokenizer"),
    }
    out_parent = tmp_path / "models"
    for name, (victim, message) in cases.items():
        src = tmp_path / name
        shutil.copytree(tiny_llama, src)
        if name == "unsupported":
            config = json.loads((src / victim).read_text())
            config["architectures"] = ["GPT2LMHeadModel"]
            (src / victim).write_text(json.dumps(config))
        else:
            (src / victim).unlink()
        result = run_baker("--model", str(src), "--out", str(out_parent / "model"))
        assert result.returncode == 1
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and message in last, result.stderr
        assert "Traceback" not in result.stderr
        assert leftovers(out_parent) == [], name


def test_missing_path_is_one_line(tmp_path: Path) -> None:
    result = run_baker("--model", "./no/such/folder", "--out", str(tmp_path / "model"))
    assert result.returncode == 1
    assert result.stderr.strip() == "error: model path './no/such/folder' does not exist"


def if_missing(out: Path, model: Path, **env: str) -> str:
    """`python -m builder --if-missing` with MODEL_NAME=model, as `make serve` runs it; returns its first line
    (what it decided) and last line (what it did) when they differ."""
    result = run_baker("--out", str(out), "--if-missing", env={"MODEL_NAME": str(model), **env})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    return lines[0] if len(lines) == 1 else f"{lines[0]} / {lines[-1]}"


def test_if_missing_rebakes_when_model_name_names_another_model(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "model"
    assert run_baker("--model", str(tiny_llama), "--out", str(out)).returncode == 0
    qwen = tiny_folder(Qwen2Config, Qwen2ForCausalLM, tmp_path / "qwen", tiny_llama, seed=1)
    assert if_missing(out, qwen) == (
        f"re-baking {out}: it holds {tiny_llama.name} (local), not qwen (local) / "
        f"baked qwen (Qwen2ForCausalLM, float32) into {out} "
        "(tensor-parallel sizes: 1, 2, 4)"
    )
    assert json.loads((out / MANIFEST).read_text())["architecture"] == "Qwen2ForCausalLM"
    assert if_missing(out, qwen) == f"model already baked in {out}"
    # A local folder is more than its name: another folder called "qwen", or the same one edited, is re-baked.
    twin = shutil.copytree(tiny_llama, tmp_path / "elsewhere" / "qwen")
    changed = (
        f"re-baking {out}: folder qwen is not the one baked (another of that name, or its files changed) / "
        f"baked qwen (LlamaForCausalLM, float32) into {out} (tensor-parallel sizes: 1, 2, 4)"
    )
    assert if_missing(out, twin) == changed
    assert json.loads((out / MANIFEST).read_text())["architecture"] == "LlamaForCausalLM"
    config = json.loads((twin / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert if_missing(out, twin) == changed
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-5


def test_if_missing_rebakes_a_local_adapter_of_the_same_name_from_another_folder(
    tmp_path: Path, tiny_llama: Path
) -> None:
    config = AutoConfig.from_pretrained(tiny_llama)
    for parent, seed in (("first", 0), ("second", 1)):
        write_adapter(
            tmp_path / parent / "sql",
            projection_shapes(config),
            config.num_hidden_layers,
            targets=["q_proj", "v_proj"],
            seed=seed,
        )
    out = tmp_path / "model"
    first = if_missing(out, tiny_llama, LORA_MODULES=f"sql={tmp_path / 'first' / 'sql'}")
    assert f"+ adapter sql (rank 4) into {out} (tensor-parallel sizes: " in first
    second = if_missing(out, tiny_llama, LORA_MODULES=f"sql={tmp_path / 'second' / 'sql'}")
    assert second.endswith(f"model already baked in {out}; adapters now sql")
    weights = "adapters/sql/adapter_model.safetensors"
    assert (out / weights).read_bytes() == (tmp_path / "second" / "sql" / "adapter_model.safetensors").read_bytes()
