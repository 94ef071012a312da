"""What the bake keeps and refuses of a Nemotron-H checkpoint: the hub layout (backbone.*, per-expert tensors) bakes
and serves transformers' tokens; what the engine does not run (another MLP activation, latent MoE projections, a
quantized checkpoint, a block letter it does not know, a tensor-parallel size that cuts the Mamba2 heads) fails in
one line naming it."""

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
from tests.engine.model.mamba_checkpoints import build_nemotron_h_checkpoint


def test_the_hub_layout_bakes_and_serves_transformers_tokens(tmp_path, baked_model_path):
    src = tmp_path / "src"
    hf = build_nemotron_h_checkpoint(src)
    for name in TOKENIZER_FILES:
        if (baked_model_path / name).exists():
            shutil.copy(baked_model_path / name, src / name)
    manifest = bake(resolve(str(src), None), tmp_path / "baked")
    assert manifest["architecture"] == "NemotronHForCausalLM"
    prompt = torch.randint(3, 128, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    assert greedy(tiny_engine(tmp_path / "baked"), {"p": prompt}, 6)["p"] == hf_greedy(hf, prompt, 6)


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
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=match) as err:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)


def test_a_tensor_parallel_size_that_cuts_the_mamba2_heads_is_refused_in_one_line(tmp_path):
    """Whole groups per rank (2), a part of one group's heads (4: more ranks than groups), never part of a head."""
    build_nemotron_h_checkpoint(tmp_path)
    assert shard_refusal(str(tmp_path), 2) is None and shard_refusal(str(tmp_path), 4) is None
    build_nemotron_h_checkpoint(tmp_path, mamba_num_heads=2, mamba_head_dim=32)
    why = shard_refusal(str(tmp_path), 4)
    assert why == "tensor_parallel_size=4 does not divide the model's 2 Mamba2 heads"
