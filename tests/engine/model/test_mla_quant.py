"""Quantized multi-head latent attention (MLA) checkpoints: DeepSeek-V3 / R1's own block FP8 release format on tiny
random DeepSeek-V3 (q_lora_rank, MoE layers), V2-Lite (q_proj) and GLM-4.7-Flash models with partial edge blocks;
compressed-tensors FP8 and W4A16, AutoAWQ and AutoGPTQ int4 on a V3. kv_b_proj is dequantised exactly once at load
into the per-head W_UK / W_UV (vLLM's way); every other projection and expert stays in its checkpoint format. Logits
over prompt lengths and decode steps equal transformers running the weights the checkpoint stands for; greedy
through the engine batched and alone; the bake through `python -m builder` and its `--plan`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from builder.__main__ import main as builder_main
from engine.errors import UnsupportedModel
from engine.model.layers.linear import Int4Linear
from engine.model.layers.mla import HeadWeights
from engine.model.layers.moe import SparseMoE
from engine.model.layers.routing import ScoreLinear
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_prefill_and_decode,
    greedy,
    hf_greedy,
    load_family,
    mixed_prompts,
    tiny_engine,
)
from tests.engine.model.mla_quant_checkpoints import (
    FP8_BLOCK,
    INT4,
    dequantize_blocks,
    quantize_folder,
    write_mla_quantized,
)
from tests.engine.model.test_hybrid_bake import _with_tokenizer

CASES = [
    "fp8_block/deepseek_v3",
    "fp8_block/deepseek_v2_lite",
    "fp8_block/glm4_moe_lite",
    "ct_fp8/deepseek_v3",
    "awq/deepseek_v3",
    "gptq/deepseek_v3",
    "ct_int4/deepseek_v3",
]
ENGINE_CASES = ["fp8_block/deepseek_v3", "fp8_block/deepseek_v2_lite", "fp8_block/glm4_moe_lite", "awq/deepseek_v3"]
ATOL = 2e-4  # float32: the int4 kernel's (code - 8) * s + (8 - z) * s rounds apart from (code - z) * s


@pytest.fixture(scope="module", params=CASES)
def mla_quant(request, tmp_path_factory, baked_model_path):
    kind, family = request.param.split("/")
    path = tmp_path_factory.mktemp(f"{kind}-{family}")
    hf = write_mla_quantized(kind, family, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=kind, family=family, hf=hf, model=model, spec=spec, path=path)


def test_kv_b_proj_is_dequantised_exactly_into_the_head_weights(mla_quant):
    """Each layer's kv_b_proj is HeadWeights holding exactly the checkpoint's weight: for block FP8, weight.float()
    times the scale_inv of its 32 x 24 block (partial on both edges), computed here from the file's tensors."""
    tensors = load_file(mla_quant.path / "model.safetensors")
    for i, (ours, theirs) in enumerate(zip(mla_quant.model.model.layers, mla_quant.hf.model.layers, strict=True)):
        head = ours.self_attn.kv_b_proj
        assert isinstance(head, HeadWeights) and head.weight.dtype == torch.float32
        assert torch.equal(head.weight, theirs.self_attn.kv_b_proj.weight), f"layer {i}"
        if mla_quant.kind == "fp8_block":
            name = f"model.layers.{i}.self_attn.kv_b_proj"
            weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
            assert weight.dtype == torch.float8_e4m3fn and all(
                n % b for n, b in zip(weight.shape, FP8_BLOCK, strict=True)
            )
            assert torch.equal(head.weight, dequantize_blocks(weight, scale, FP8_BLOCK)), f"layer {i}"


def test_every_other_projection_serves_its_checkpoint_weight_and_routers_stay_float(mla_quant):
    """q / kv_a / o and each MLP's and expert's projections compute the weight the checkpoint stands for (AWQ's
    through the int4 kernel where its rows allow); the routers are float32 ScoreLinears."""
    int4 = mla_quant.kind in INT4
    for ours, theirs in zip(mla_quant.model.model.layers, mla_quant.hf.model.layers, strict=True):
        names = ["q_proj"] if mla_quant.family == "deepseek_v2_lite" else ["q_a_proj", "q_b_proj"]
        pairs = [(getattr(ours.self_attn, n), getattr(theirs.self_attn, n).weight) for n in [*names, "o_proj"]]
        pairs.append((ours.self_attn.kv_a_proj_with_mqa, theirs.self_attn.kv_a_proj_with_mqa.weight))
        if isinstance(ours.mlp, SparseMoE):
            assert isinstance(ours.mlp.gate, ScoreLinear) and ours.mlp.gate.weight.dtype == torch.float32
            experts = theirs.mlp.experts
            for e, (gate_up, down) in enumerate(ours.mlp.experts.linears):
                pairs += [(gate_up, experts.gate_up_proj[e]), (down, experts.down_proj[e])]
        for module, weight in pairs:
            assert isinstance(module, nn.Linear | Int4Linear)
            with torch.inference_mode():
                got = module(torch.eye(weight.shape[1])).t()
            torch.testing.assert_close(got, weight, atol=1e-5, rtol=1e-5)
        assert isinstance(ours.self_attn.o_proj, Int4Linear) == int4


def test_prefill_lengths_and_decode_match_transformers(mla_quant):
    check_prefill_and_decode(
        mla_quant.model, mla_quant.spec, mla_quant.hf, lengths=(1, 7, 30), decode_steps=4, atol=ATOL
    )


@pytest.mark.parametrize("mla_quant", ENGINE_CASES, indirect=True)
def test_engine_greedy_equals_transformers_batched_and_solo(mla_quant):
    check_engine_greedy(mla_quant.path, mla_quant.hf)


def test_deepseeks_fp8_release_bakes_plans_and_serves_transformers_tokens(tmp_path, baked_model_path, capsys):
    """`python -m builder` on a local folder in DeepSeek-V3's FP8 format keeps it FP8, `--plan` prints its latent
    pages, and the baked folder serves transformers' greedy tokens on the dequantised weights."""
    src, out = tmp_path / "src", tmp_path / "baked"
    hf = write_mla_quantized("fp8_block", "deepseek_v3", src)
    _with_tokenizer(src, baked_model_path)
    assert builder_main(["--model", str(src), "--out", str(out)]) == 0
    assert (
        load_file(out / "model.safetensors")["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    )
    capsys.readouterr()
    assert builder_main(["--plan", "--out", str(out)]) == 0
    assert "multi-head latent: 40 values per token per layer" in capsys.readouterr().out
    prompt = torch.randint(3, 128, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    assert greedy(tiny_engine(out), {"p": prompt}, 6)["p"] == hf_greedy(hf, prompt, 6)


def test_a_kv_b_proj_scale_of_the_wrong_shape_fails_the_bake_in_one_line(tmp_path):
    write_mla_quantized("fp8_block", "deepseek_v2_lite", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        UnsupportedModel, match=r"^fp8: model\.layers\.1\.self_attn\.kv_b_proj\.weight_scale_inv has sh"
    ):
        check_checkpoint(str(tmp_path))


@pytest.mark.parametrize("mla_quant", ["fp8_block/glm4_moe_lite"], indirect=True)
def test_bfloat16_on_cpu_holds_kv_b_proj_in_bfloat16_and_serves(mla_quant):
    """bfloat16 (the CPU default): kv_b_proj is the exact dequantised weight rounded once to bfloat16, and the engine
    serves greedy requests to the end."""
    model, _ = load_model(str(mla_quant.path), torch.bfloat16, torch.device("cpu"))
    for ours, theirs in zip(model.model.layers, mla_quant.hf.model.layers, strict=True):
        weight = ours.self_attn.kv_b_proj.weight
        assert torch.equal(weight, theirs.self_attn.kv_b_proj.weight.detach().bfloat16())
    out = greedy(tiny_engine(mla_quant.path, dtype="bfloat16"), mixed_prompts(), max_tokens=6)
    assert all(len(tokens) == 6 for tokens in out.values())


def test_deepseeks_fp8_next_n_layer_serves_as_the_mtp_head(tmp_path, baked_model_path):
    """DeepSeek-V3's FP8 release quantizes its next-n layer too (eh_proj, the layer's MLA and experts): the `mtp` head
    loads it, its kv_b_proj dequantised as the target's, and its guesses, a copy of the target's layer on shifted
    tokens, are accepted while the output stays the target's own."""
    from engine.config import SpeculativeConfig
    from tests.engine.core.hybrid_spec import hybrid_requests, run_checked, tokens
    from tests.engine.core.next_n_spec import add_agreeing_next_n, build_target
    from tests.engine.core.test_speculative_next_n import ONE_LAYER

    hf = build_target("deepseek_v3", tmp_path, baked_model_path, **ONE_LAYER["deepseek_v3"])
    add_agreeing_next_n(tmp_path, hf)
    quantize_folder("fp8_block", tmp_path, None, FP8_BLOCK)
    assert "model.layers.1.self_attn.kv_b_proj.weight_scale_inv" in load_file(tmp_path / "model.safetensors")
    requests = hybrid_requests()
    want = tokens(run_checked(tiny_engine(tmp_path), requests))
    spec = tiny_engine(tmp_path, speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    assert tokens(run_checked(spec, requests)) == want
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
    heads = [m for m in spec.speculator.proposer.head.modules() if isinstance(m, HeadWeights)]
    assert heads and all(h.weight.dtype == torch.float32 for h in heads)
