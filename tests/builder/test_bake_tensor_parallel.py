"""The bake records the TENSOR_PARALLEL_SIZE values among 1, 2, 4 and 8 that split its checkpoint, by start-up's own
check: a size it leaves out stops the start in one line (before any rank starts), a size it lists passes the check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from builder.__main__ import main as builder_main
from builder.bake import MANIFEST
from engine.config import EngineConfig
from engine.core.distributed.ranks import rank_config
from engine.errors import StartupError
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.core.distributed.tp_models import save_tp_model
from tests.engine.model.quant_writers import write_quantized

# A size the checkpoint cannot take -> the line start-up refuses it with.
REFUSED = {
    "awq": {
        4: "tensor_parallel_size=4 would cut awq's qzeros of model.layers.0.self_attn.o_proj (128 inputs an "
        "entry): a rank holds 64 inputs from 192",
        8: "tensor_parallel_size=8 does not divide the model's 4 attention heads",
    },
    "gemma4_text": {8: "tensor_parallel_size=8 does not divide the model's 4 attention heads"},
}


@pytest.mark.parametrize(("kind", "sizes"), [("awq", [1, 2]), ("gemma4_text", [1, 2, 4])])
def test_the_manifest_lists_the_sizes_start_up_accepts(kind, sizes, tmp_path, baked_model_path):
    src, out = tmp_path / "src", tmp_path / "baked"
    if kind == "awq":  # groups of 128 inputs: o_proj's 256 leave a whole group to each of 2 ranks, half of one to 4
        write_quantized(kind, "llama", src)
        for name in TOKENIZER_FILES:
            if (baked_model_path / name).exists():
                shutil.copy(baked_model_path / name, src / name)
    else:  # 4 heads, 2 local KV heads and 1 global one, per-layer inputs, experts
        save_tp_model(kind, src, baked_model_path)
    assert builder_main(["--model", str(src), "--out", str(out)]) == 0
    assert json.loads((out / MANIFEST).read_text())["tensor_parallel_sizes"] == sizes
    for size in (1, 2, 4, 8):
        config = EngineConfig(model_path=str(out), tensor_parallel_size=size)
        if size in sizes:
            assert rank_config(config, torch.device("cpu")).tensor_parallel_size == size
            continue
        with pytest.raises(StartupError) as info:
            rank_config(config, torch.device("cpu"))
        assert info.value.message == REFUSED[kind][size]
