"""What the bake keeps and refuses of a Granite 4.0-H checkpoint: the hub layout (mamba.*, block_sparse_moe.*,
shared_mlp.*) bakes and serves transformers' tokens, and so does transformers 5's MoE naming (router,
experts.gate_up_proj); what the engine does not run (another activation, a quantized checkpoint, a layer type it does
not know, more ranks than Mamba2 heads) fails in one line naming it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.loader import shard_refusal
from tests.engine.model.family_parity import greedy, hf_greedy, tiny_engine
from tests.engine.model.mamba_checkpoints import build_granite_hybrid_checkpoint
from tests.engine.model.mamba_family import check_bake_serves, check_refused_in_one_line, copy_tokenizer

TRANSFORMERS_5_NAMES = (
    (".block_sparse_moe.router.layer.", ".block_sparse_moe.router."),
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
)


def test_the_hub_layout_bakes_and_serves_transformers_tokens(tmp_path, baked_model_path):
    src = tmp_path / "src"
    hf = build_granite_hybrid_checkpoint(src)
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())  # the hub's configs name the layer types so
    config.update(layer_types=["mamba", "attention", "mamba", "mamba"], time_step_limit=[0.0, float("inf")])
    (src / "config.json").write_text(json.dumps(config))
    check_bake_serves(
        src, tmp_path / "baked", hf, baked_model_path=baked_model_path, architecture="GraniteMoeHybridForCausalLM"
    )


def test_transformers_5_moe_names_serve_transformers_tokens(tmp_path, baked_model_path):
    hf = build_granite_hybrid_checkpoint(tmp_path)
    copy_tokenizer(tmp_path, baked_model_path)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for hub, ours in TRANSFORMERS_5_NAMES:
            name = name.replace(hub, ours)
        renamed[name] = tensor
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompt = torch.randint(3, 128, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    assert greedy(tiny_engine(tmp_path), {"p": prompt}, 6)["p"] == hf_greedy(hf, prompt, 6)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized Granite 4.0-H checkpoints are not served yet"),
        ({"layer_types": ["mamba", "attention", "mamba", "sliding_attention"]}, "layer type 'sliding_attention'"),
    ],
)
def test_what_the_engine_does_not_run_fails_the_check_in_one_line(change, match, tmp_path):
    build_granite_hybrid_checkpoint(tmp_path)
    check_refused_in_one_line(tmp_path, change, match)


def test_more_ranks_than_mamba2_groups_split_the_heads_and_too_many_are_refused_in_one_line(tmp_path):
    """Granite 4.0-H's releases have one Mamba2 group: ranks split its heads, as many ranks as there are heads."""
    build_granite_hybrid_checkpoint(tmp_path, mamba_n_groups=1, mamba_n_heads=2, mamba_d_head=32)
    assert shard_refusal(str(tmp_path), 2) is None
    why = shard_refusal(str(tmp_path), 4)
    assert why == "tensor_parallel_size=4 does not divide the model's 2 Mamba2 heads"
