"""What the bake keeps and refuses of a hybrid checkpoint: every Qwen3.5 / Qwen3-Next layout bakes and serves
transformers' tokens, the multi-token-prediction weights (mtp.*) stay in the bake, and a layer type the engine does
not run fails the check in one line naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from builder.bake import bake
from builder.sources import resolve
from engine.errors import UnsupportedModel
from engine.model.loader import check_checkpoint
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.model.family_parity import greedy, hf_greedy, tiny_engine
from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint


def _with_tokenizer(path, baked_model_path):
    for name in TOKENIZER_FILES:
        if (baked_model_path / name).exists():
            shutil.copy(baked_model_path / name, path / name)


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5"])
def test_each_layout_bakes_keeps_mtp_and_serves_transformers_tokens(kind, tmp_path, baked_model_path):
    src = tmp_path / "src"
    hf = build_hybrid_checkpoint(kind, src)
    _with_tokenizer(src, baked_model_path)
    weights = load_file(str(src / "model.safetensors"))
    weights["mtp.fc.weight"] = torch.randn(64, 128)  # the hub checkpoints' next-token-prediction head
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "baked"
    manifest = bake(resolve(str(src), None), out)
    assert manifest["architecture"] == hf.config.architectures[0]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "mtp.fc.weight" in f.keys()
    prompt = torch.randint(3, 128, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    assert greedy(tiny_engine(out), {"p": prompt}, 6)["p"] == hf_greedy(hf, prompt, 6)


@pytest.mark.parametrize("layer_type", ["mamba", "linear_attention_v2"])
def test_an_unknown_layer_type_fails_the_check_in_one_line(layer_type, tmp_path):
    build_hybrid_checkpoint("qwen3_5_text", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"][1] = layer_type
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=f"layer type '{layer_type}' is not supported") as err:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)
