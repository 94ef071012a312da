"""The folder check (the bake's, and the worker's on a hub cache snapshot) refuses what loading the model refuses at
start: what start-up asks of the model built from its config (rotary, mrope sections) and of its KV scales, each in
the one line start-up gives, without reading the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import UnsupportedModel
from engine.model.folder_check import check_model_folder
from engine.model.loader import load_model
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.model.qwen_vl_checkpoints import build_qwen_vl


def with_tokenizer(folder: Path, baked: Path) -> Path:
    for name in TOKENIZER_FILES:
        if (baked / name).exists():
            shutil.copy(baked / name, folder / name)
    return folder


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def add_tensor(folder: Path, name: str, tensor: torch.Tensor) -> None:
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, name: tensor}, folder / "model.safetensors", metadata={"format": "pt"})


def assert_refused_alike(folder: Path, message: str) -> None:
    with pytest.raises(UnsupportedModel) as at_start:
        load_model(str(folder), torch.float32, torch.device("cpu"))
    assert at_start.value.message == message
    with pytest.raises(UnsupportedModel) as at_check:
        check_model_folder(folder)
    assert str(at_check.value) == f"the engine cannot run this model: {message}"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, baked_model_path: Path, tiny_checkpoint) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_checkpoint("llama", folder)
    return with_tokenizer(folder, baked_model_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c["rope_parameters"].update(partial_rotary_factor=0.75),
            "partial_rotary_factor != 1 is not supported",
        ),
        (
            lambda c: c.update(rope_parameters={"rope_type": "su", "rope_theta": 10000.0}),
            "rope type 'su' is not supported",
        ),
    ],
    ids=["partial-rotary", "rope-type"],
)
def test_a_rope_start_up_refuses_fails_the_check(tmp_path: Path, tiny_llama: Path, change, message) -> None:
    folder = shutil.copytree(tiny_llama, tmp_path / "model")
    edit_config(folder, change)
    assert_refused_alike(folder, message)


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        (
            "model.layers.0.self_attn.k_scale",
            (2,),
            "KV cache scale 'model.layers.0.self_attn.k_scale' has shape (2,): only per-tensor KV scales are supported",
        ),
        ("model.layers.7.self_attn.v_scale", (), "unexpected tensor 'model.layers.7.self_attn.v_scale' in checkpoint"),
    ],
    ids=["per-head", "no-such-layer"],
)
def test_a_kv_scale_start_up_refuses_fails_the_check(tmp_path: Path, tiny_llama: Path, name, shape, message) -> None:
    folder = shutil.copytree(tiny_llama, tmp_path / "model")
    add_tensor(folder, name, torch.ones(shape))
    assert_refused_alike(folder, message)


def test_an_mrope_section_start_up_refuses_fails_the_check(tmp_path: Path, baked_model_path: Path) -> None:
    build_qwen_vl("qwen3_vl", tmp_path, baked_model_path)
    edit_config(tmp_path, lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 4]))
    assert_refused_alike(tmp_path, "mrope_section [4, 4] must be three numbers (t, h, w)")


def test_the_default_model_passes_the_check(baked_model_path: Path) -> None:
    assert check_model_folder(baked_model_path) == "LlamaForCausalLM"


@pytest.mark.parametrize("layout", ["transformers5", "hub_release"])
def test_a_qwen2_5_vl_folder_in_either_layout_passes_the_check(tmp_path: Path, baked_model_path: Path, layout) -> None:
    from tests.engine.model.test_qwen2_5_vl_parity import release_layout

    build_qwen_vl("qwen2_5_vl", tmp_path, baked_model_path)
    if layout == "hub_release":
        release_layout(tmp_path)
    with_tokenizer(tmp_path, baked_model_path)
    assert check_model_folder(tmp_path) == "Qwen2_5_VLForConditionalGeneration"
