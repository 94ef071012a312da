"""What the bake keeps and refuses of a Falcon-H1 checkpoint: transformers' layout bakes and serves transformers'
tokens; what the engine does not run (another activation, a quantized checkpoint, Mamba2 heads that do not split into
whole groups, a tensor-parallel size that cuts the Mamba2 groups) fails in one line naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from builder.bake import bake
from builder.sources import resolve
from engine.errors import UnsupportedModel
from engine.model.loader import check_checkpoint, shard_refusal
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.model.family_parity import greedy, hf_greedy, tiny_engine
from tests.engine.model.mamba_checkpoints import build_falcon_h1_checkpoint


def test_the_checkpoint_bakes_and_serves_transformers_tokens(tmp_path, baked_model_path):
    src = tmp_path / "src"
    hf = build_falcon_h1_checkpoint(src)
    for name in TOKENIZER_FILES:
        if (baked_model_path / name).exists():
            shutil.copy(baked_model_path / name, src / name)
    manifest = bake(resolve(str(src), None), tmp_path / "baked")
    assert manifest["architecture"] == "FalconH1ForCausalLM"
    prompt = torch.randint(3, 128, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    assert greedy(tiny_engine(tmp_path / "baked"), {"p": prompt}, 6)["p"] == hf_greedy(hf, prompt, 6)


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
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=match) as err:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)


def test_a_tensor_parallel_size_that_cuts_the_mamba2_heads_is_refused_in_one_line(tmp_path):
    """Two groups of 4 Mamba2 heads: 2 ranks take a group each, 4 ranks half a group's heads each (the gated norm
    summed across the group's ranks); 8 ranks would cut the 4 attention heads, 3 the groups."""
    build_falcon_h1_checkpoint(tmp_path)
    assert shard_refusal(str(tmp_path), 2) is None
    assert shard_refusal(str(tmp_path), 4) is None
    refused = shard_refusal(str(tmp_path), 3)
    assert refused is not None and "\n" not in refused and "tensor_parallel_size=3" in refused
