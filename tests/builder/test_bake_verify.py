"""The bake checks what it is given: a hub cache blob whose bytes are not the SHA-256 it is named by (the hub names
large files' blobs so) fails the bake in one line, as does a truncated safetensors file; nothing is left behind."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_bake import leftovers, run_baker, tiny_folder
from transformers import LlamaConfig, LlamaForCausalLM

from builder.bake import MANIFEST

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, baked_model_path: Path) -> Path:
    return tiny_folder(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("tiny-llama"), baked_model_path, seed=0)


def hub_cache(root: Path, model: Path) -> Path:
    """A hub cache of acme/tiny-llama at COMMIT laid out as huggingface_hub writes it: the weights in a blob named
    by their SHA-256, the snapshot's file a link to it (small files are plain copies here). Returns the blob."""
    repo = root / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model, snapshot)
    (repo / "blobs").mkdir()
    weights = snapshot / "model.safetensors"
    blob = repo / "blobs" / hashlib.sha256(weights.read_bytes()).hexdigest()
    weights.rename(blob)
    weights.symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return blob


def bake_from(cache: Path, out: Path):
    return run_baker(
        "--out", str(out), env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "MODEL_NAME": "acme/tiny-llama"}
    )


def test_a_hub_blob_with_its_sum_bakes_with_that_sum_and_every_size(tmp_path: Path, tiny_llama: Path) -> None:
    blob = hub_cache(tmp_path / "hub", tiny_llama)
    out = tmp_path / "models" / "model"
    result = bake_from(tmp_path / "hub", out)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"] == blob.name
    assert manifest["sizes"] == {name: (out / name).stat().st_size for name in manifest["files"]}


def test_a_corrupted_hub_blob_fails_the_bake(tmp_path: Path, tiny_llama: Path) -> None:
    blob = hub_cache(tmp_path / "hub", tiny_llama)
    with blob.open("r+b") as f:  # same size, other bytes: the header still parses, the weights still load
        f.seek(-64, 2)
        f.write(bytes(64))
    out_parent = tmp_path / "models"
    result = bake_from(tmp_path / "hub", out_parent / "model")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model.safetensors is not the file the hub gives") and blob.name in last, (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert leftovers(out_parent) == []


def test_a_truncated_weight_file_fails_the_bake(tmp_path: Path, tiny_llama: Path) -> None:
    src = shutil.copytree(tiny_llama, tmp_path / "truncated")
    weights = src / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 1)
    out_parent = tmp_path / "models"
    result = run_baker("--model", str(src), "--out", str(out_parent / "model"))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "model.safetensors cannot be read as safetensors" in last, result.stderr
    assert "Traceback" not in result.stderr
    assert leftovers(out_parent) == []
