"""What the bake keeps and refuses of a Nemotron-H checkpoint: the hub layout (backbone.*, per-expert tensors) bakes
and serves transformers' tokens; what the engine does not run (another MLP activation, latent MoE projections, a
quantized checkpoint, a block letter it does not know, a tensor-parallel size that cuts the Mamba2 heads) fails in
one line naming it."""

from __future__ import annotations

import pytest

from engine.model.loader import shard_refusal
from tests.engine.model.mamba_checkpoints import build_nemotron_h_checkpoint
from tests.engine.model.mamba_family import check_bake_serves, check_refused_in_one_line


def test_the_hub_layout_bakes_and_serves_transformers_tokens(tmp_path, baked_model_path):
    hf = build_nemotron_h_checkpoint(tmp_path / "src")
    check_bake_serves(
        tmp_path / "src", tmp_path / "baked", hf, baked_model_path=baked_model_path, architecture="NemotronHForCausalLM"
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported"),
        ({"moe_latent_size": 32}, "moe_latent_size"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized Nemotron-H checkpoints are not served yet"),
        ({"layers_block_type": None, "hybrid_override_pattern": "ME*M-X"}, "blocks other than M, \\*, - and E"),
    ],
)
def test_what_the_engine_does_not_run_fails_the_check_in_one_line(change, match, tmp_path):
    build_nemotron_h_checkpoint(tmp_path)
    check_refused_in_one_line(tmp_path, change, match)


def test_a_tensor_parallel_size_that_cuts_the_mamba2_heads_is_refused_in_one_line(tmp_path):
    """Whole groups per rank (2), a part of one group's heads (4: more ranks than groups), never part of a head."""
    build_nemotron_h_checkpoint(tmp_path)
    assert shard_refusal(str(tmp_path), 2) is None and shard_refusal(str(tmp_path), 4) is None
    build_nemotron_h_checkpoint(tmp_path, mamba_num_heads=2, mamba_head_dim=32)
    why = shard_refusal(str(tmp_path), 4)
    assert why == "tensor_parallel_size=4 does not divide the model's 2 Mamba2 heads"
