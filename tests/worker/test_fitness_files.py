"""The fitness check of the model's files on real bakes: by default each file the manifest lists is there with
its recorded size (no weight byte is read); VERIFY_MODEL_SHA256 adds the SHA-256 sums; a manifest from before
sizes were recorded checks presence only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.fitness import model_files_mismatch
from worker.settings import load_settings


@pytest.fixture(scope="module")
def tiny_bake(baked_model_path, tmp_path_factory) -> Path:
    """A two-layer random-weight Llama with the default model's tokenizer, baked by this builder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from builder.bake import bake
    from builder.sources import resolve

    source = tmp_path_factory.mktemp("tiny-source")
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
    LlamaForCausalLM(config).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(baked_model_path / name, source / name)
    out = tmp_path_factory.mktemp("tiny-bake") / "model"
    bake(resolve(str(source), None), out)
    return out


@pytest.fixture
def bake_copy(tiny_bake, tmp_path) -> Path:
    return shutil.copytree(tiny_bake, tmp_path / "model")


def change_last_bytes(path: Path) -> None:
    """Flip the file's last 64 bytes (tensor data): the same size, another SHA-256."""
    with path.open("r+b") as f:
        f.seek(-64, 2)
        flipped = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(-64, 2)
        f.write(flipped)


def test_the_bake_records_every_files_size(tiny_bake) -> None:
    manifest = json.loads((tiny_bake / "manifest.json").read_text())
    assert set(manifest["sizes"]) == set(manifest["files"]) >= {"model.safetensors", "tokenizer.json"}
    assert all(manifest["sizes"][n] == (tiny_bake / n).stat().st_size for n in manifest["sizes"])
    assert model_files_mismatch(str(tiny_bake)) == [] == model_files_mismatch(str(tiny_bake), sha256=True)


def test_changed_bytes_of_the_same_size_pass_by_default_and_fail_with_the_sums(bake_copy) -> None:
    weights = bake_copy / "model.safetensors"
    size = weights.stat().st_size
    change_last_bytes(weights)
    assert weights.stat().st_size == size
    assert model_files_mismatch(str(bake_copy)) == []
    assert model_files_mismatch(str(bake_copy), sha256=True) == ["model.safetensors"]


def test_a_truncated_or_missing_file_fails_by_default(bake_copy) -> None:
    weights = bake_copy / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 1)
    (bake_copy / "tokenizer.json").unlink()
    assert model_files_mismatch(str(bake_copy)) == ["model.safetensors", "tokenizer.json"]


def test_a_manifest_without_sizes_checks_presence_only(bake_copy) -> None:
    manifest = json.loads((bake_copy / "manifest.json").read_text())
    del manifest["sizes"]
    (bake_copy / "manifest.json").write_text(json.dumps(manifest))
    weights = bake_copy / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 1)
    assert model_files_mismatch(str(bake_copy)) == []
    assert model_files_mismatch(str(bake_copy), sha256=True) == ["model.safetensors"]
    (bake_copy / "config.json").unlink()
    assert model_files_mismatch(str(bake_copy)) == ["config.json"]


def test_verify_model_sha256_is_off_unless_set() -> None:
    assert load_settings({}).verify_model_sha256 is False
    assert load_settings({"VERIFY_MODEL_SHA256": "true"}).verify_model_sha256 is True
    assert load_settings({"VERIFY_MODEL_SHA256": "0"}).verify_model_sha256 is False
