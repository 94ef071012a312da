"""gpt-oss against transformers on a tiny random config in float32: q/k/v/o biases, sink logits, two sliding-window
layers (window 8) around a full one, yarn rope, a biased top-2-of-4 router and clamped-SwiGLU experts with biases;
from float experts as save_pretrained writes them and from MXFP4 experts as the hub stores them (the same weights:
transformers' convert_moe_packed_tensors made the reference's)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import UnsupportedModel
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.family_parity import check_engine_greedy, check_prefill_and_decode, load_family
from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss


@pytest.fixture(scope="module", params=["float", "mxfp4"])
def gpt_oss(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("gpt-oss-" + request.param)
    hf = build_gpt_oss(path, request.param)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(layout=request.param, hf=hf, model=model, spec=spec, path=path)


def test_layers_follow_the_config(gpt_oss):
    assert [(g.layers, g.window) for g in gpt_oss.spec.kv_groups] == [((0, 2), 8), ((1,), None)]
    for ours, theirs in zip(gpt_oss.model.model.layers, gpt_oss.hf.model.layers, strict=True):
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
        assert torch.equal(ours.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj.transpose(1, 2))
        assert torch.equal(ours.mlp.experts.down_proj, theirs.mlp.experts.down_proj.transpose(1, 2))


def test_prefill_lengths_and_decode_match_transformers(gpt_oss):
    # the 30-token prompt is longer than the window, and the 7-token one decodes past it
    check_prefill_and_decode(gpt_oss.model, gpt_oss.spec, gpt_oss.hf, lengths=(1, 7, 30), decode_steps=10)


def test_engine_greedy_equals_transformers_batched_and_solo(gpt_oss):
    """Through the engine: mixed prompts, one past the window, chunked under a 16-token budget and a shared prefix
    served from the cache the second time, give each prompt the tokens it gets alone and from transformers."""
    check_engine_greedy(gpt_oss.path, gpt_oss.hf)


def test_mxfp4_loads_to_bfloat16_as_transformers_dequantises(gpt_oss):
    """bfloat16 serving: the experts hold exactly transformers' bf16 dequantisation, and the stacks' checkpoint
    tensors are gone (nothing uint8 is left to serve)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if gpt_oss.layout != "mxfp4":
        pytest.skip("MXFP4 checkpoints only")
    model, _ = load_model(str(gpt_oss.path), torch.bfloat16, torch.device("cpu"))
    tensors = load_file(str(gpt_oss.path / "model.safetensors"))
    assert not any(p.dtype == torch.uint8 for p in model.parameters())
    experts = model.model.layers[2].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        prefix = f"model.layers.2.mlp.experts.{proj}"
        theirs = convert_moe_packed_tensors(
            tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"], dtype=torch.bfloat16
        )
        ours = getattr(experts, proj) if experts.linears is None else None
        if ours is None:  # CPU bf16 packs each expert into its own linear: read the weights back out
            index = 0 if proj == "gate_up_proj" else 1
            ours = torch.stack(
                [lin[index](torch.eye(theirs.shape[1], dtype=torch.bfloat16)).t() for lin in experts.linears]
            )
        assert torch.equal(ours, theirs.transpose(1, 2)), proj


def test_mxfp4_shapes_are_checked_at_bake(gpt_oss, tmp_path):
    """check_checkpoint (the bake) reads the headers: blocks of the wrong width fail with one line naming them."""
    if gpt_oss.layout != "mxfp4":
        pytest.skip("MXFP4 checkpoints only")
    for f in gpt_oss.path.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    assert check_checkpoint(str(tmp_path)) == "GptOssForCausalLM"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name][:, :, :1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=f"{name}.*shape") as err:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)

    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    tensors = {k: v for k, v in tensors.items() if "_blocks" not in k and "_scales" not in k}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="mxfp4 but no expert stack"):
        check_checkpoint(str(tmp_path))
