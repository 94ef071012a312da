"""What the bake keeps and refuses of a Falcon-H1 checkpoint: transformers' layout bakes and serves transformers'
tokens; what the engine does not run (another activation, a quantized checkpoint, Mamba2 heads that do not split into
whole groups, a tensor-parallel size that cuts the Mamba2 groups) fails in one line naming it."""

from __future__ import annotations

import pytest

from engine.model.loader import shard_refusal
from tests.engine.model.mamba_checkpoints import build_falcon_h1_checkpoint
from tests.engine.model.mamba_family import check_bake_serves, check_refused_in_one_line


def test_the_checkpoint_bakes_and_serves_transformers_tokens(tmp_path, baked_model_path):
    hf = build_falcon_h1_checkpoint(tmp_path / "src")
    check_bake_serves(
        tmp_path / "src", tmp_path / "baked", hf, baked_model_path=baked_model_path, architecture="FalconH1ForCausalLM"
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized Falcon-H1 checkpoints are not served yet"),
        ({"mamba_n_groups": 3}, "the heads do not split mamba_d_ssm=64 into whole groups"),
    ],
)
def test_what_the_engine_does_not_run_fails_the_check_in_one_line(change, match, tmp_path):
    build_falcon_h1_checkpoint(tmp_path)
    check_refused_in_one_line(tmp_path, change, match)


def test_a_tensor_parallel_size_that_cuts_the_mamba2_heads_is_refused_in_one_line(tmp_path):
    """Two groups of 4 Mamba2 heads: 2 ranks take a group each, 4 ranks half a group's heads each (the gated norm
    summed across the group's ranks); 8 ranks would cut the 4 attention heads, 3 the groups."""
    build_falcon_h1_checkpoint(tmp_path)
    assert shard_refusal(str(tmp_path), 2) is None
    assert shard_refusal(str(tmp_path), 4) is None
    refused = shard_refusal(str(tmp_path), 3)
    assert refused is not None and "\n" not in refused and "tensor_parallel_size=3" in refused
