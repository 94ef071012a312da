"""The bake's checkpoint check: every tensor has a place of its shape and every parameter is filled, read from
the safetensors headers alone."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import UnsupportedModel
from engine.model.loader import check_checkpoint


def _rewrite(folder, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_whole_checkpoint_passes(tmp_path, tiny_checkpoint):
    tiny_checkpoint("qwen3", tmp_path)
    assert check_checkpoint(str(tmp_path)) == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            "lacks tensors for: model.layers.1.self_attn.qkv_proj",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(127, 64)}),
            r"'model.layers.0.mlp.up_proj.weight' has shape \(127, 64\), expected \(128, 64\)",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
            "unexpected tensor 'model.layers.0.mlp.extra",
        ),
    ],
)
def test_a_broken_checkpoint_fails_with_one_line_naming_the_tensor(tmp_path, tiny_checkpoint, change, message):
    tiny_checkpoint("qwen3", tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(UnsupportedModel, match=message) as info:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)
