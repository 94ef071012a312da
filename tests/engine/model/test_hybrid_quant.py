"""Quantized hybrid checkpoints as the hub ships them (hybrid_quant_checkpoints.py): Qwen3.5 dense, Qwen3.5 MoE,
Qwen3-Next (fused in_proj_qkvz, whose 128-row FP8 blocks straddle its per-key-head q|k|v|z boundaries) and the
text model of a Qwen3.5 image-text checkpoint, each in Qwen's block FP8, AutoAWQ's GEMM layout and compressed-tensors
W4A16 (group 128 asymmetric, group 32 symmetric). Each passes the bake's check, every projection computes exactly
the weight its tensors stand for (INT4 through the CPU int4 kernel where the rows allow it, FP8 dequantised), the
float modules of the release (in_proj_a / in_proj_b / in_proj_ba, routers, shared-expert gates) stay float, and the
logits over prompts longer than one DeltaNet chunk and decode steps are transformers' on the dequantised weights."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from engine.model.layers.linear import Int4Linear
from engine.model.layers.moe import SparseMoE
from engine.model.layers.routing import ScoreLinear
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.family_parity import check_engine_greedy, check_prefill_and_decode, load_case, load_family
from tests.engine.model.hybrid_quant_checkpoints import write_hybrid_quantized

INT4 = {"awq", "ct_int4", "ct_int4_g32"}
KINDS = ["fp8_block", "awq", "ct_int4", "ct_int4_g32"]
MODELS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5"]
CASES = [f"{kind}/{model}" for kind in KINDS for model in MODELS]
# NOTE: past loading, every INT4 format serves through the same modules, as every FP8 one does, and the logits
# above already hold each case to transformers; the engine runs (about 20 s each here) cover Qwen's FP8 release
# shape and the fused Qwen3-Next in INT4 by default, each other model type in a third format under -m slow (and
# test_hybrid_quant_bake serves one of each format).
ENGINE_CASES = ["fp8_block/qwen3_5", "awq/qwen3_next"]
SLOW_ENGINE_CASES = ["ct_int4/qwen3_5_moe_text", "ct_int4_g32/qwen3_5_text"]
ATOL = 2e-4  # float32: the int4 kernel's (code - 8) * s + (8 - z) * s rounds apart from (code - z) * s


@pytest.fixture(scope="module", params=CASES)
def qh(request, tmp_path_factory, baked_model_path):
    return load_case(request.param, tmp_path_factory, baked_model_path, write_hybrid_quantized)


def hf_layers(hf):
    return (hf.model.language_model if hasattr(hf.model, "language_model") else hf.model).layers


def projections(ours, theirs) -> list[tuple[str, nn.Module, torch.Tensor, bool]]:
    """(name, our serving module, the transformers weight it computes, whether the release quantizes it) for every
    projection of a decoder layer."""
    out = []
    if hasattr(theirs, "linear_attn"):
        mine, ref = ours.linear_attn, theirs.linear_attn
        names = (
            ("in_proj_qkvz", "in_proj_ba")
            if hasattr(ref, "in_proj_qkvz")
            else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        )
        out += [
            (n, getattr(mine, n), getattr(ref, n).weight, n not in ("in_proj_ba", "in_proj_b", "in_proj_a"))
            for n in (*names, "out_proj")
        ]
    else:
        attn = theirs.self_attn
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        out += [
            ("qkv_proj", ours.self_attn.qkv_proj, qkv, True),
            ("o_proj", ours.self_attn.o_proj, attn.o_proj.weight, True),
        ]
    mlps = [(ours.mlp, theirs.mlp)]
    if isinstance(ours.mlp, SparseMoE):
        mlps = [(ours.mlp.shared_expert, theirs.mlp.shared_expert)]
        for e, (gate_up, down) in enumerate(ours.mlp.experts.linears or ()):  # None: float experts
            out += [
                (f"expert {e} gate_up", gate_up, theirs.mlp.experts.gate_up_proj[e], True),
                (f"expert {e} down", down, theirs.mlp.experts.down_proj[e], True),
            ]
    for mine, ref in mlps:
        out += [
            ("gate_up_proj", mine.gate_up_proj, torch.cat([ref.gate_proj.weight, ref.up_proj.weight]), True),
            ("down_proj", mine.down_proj, ref.down_proj.weight, True),
        ]
    return out


def test_bake_check_passes_and_each_projection_computes_its_dequantised_weight(qh):
    assert check_checkpoint(str(qh.path)) == type(qh.hf).__name__
    for i in (0, 3):  # a Gated DeltaNet layer and the full-attention layer
        ours, theirs = qh.model.model.layers[i], hf_layers(qh.hf)[i]
        for name, module, weight, quantized in projections(ours, theirs):
            rows = weight.shape[0]
            kernel = quantized and qh.kind in INT4 and rows % 16 == 0
            assert isinstance(module, Int4Linear if kernel else nn.Linear), (i, name)
            with torch.inference_mode():
                got = module(torch.eye(weight.shape[1])).t()
            torch.testing.assert_close(got, weight, atol=1e-5, rtol=1e-5, msg=f"layer {i} {name}")
        if isinstance(ours.mlp, SparseMoE):  # quantized experts, one module each; float router and shared gate
            assert ours.mlp.experts.linears is not None
            assert isinstance(ours.mlp.gate, ScoreLinear) and isinstance(ours.mlp.shared_expert_gate, ScoreLinear)


def test_the_config_lists_the_hybrid_float_modules(qh):
    qc = json.loads((qh.path / "config.json").read_text())["quantization_config"]
    listed = set(qc.get("modules_to_not_convert") or qc.get("ignore"))
    prefix = "model.language_model.layers.0" if qh.family == "qwen3_5" else "model.layers.0"
    small = ["in_proj_ba"] if qh.family == "qwen3_next" else ["in_proj_a", "in_proj_b"]
    assert {f"{prefix}.linear_attn.{n}" for n in (*small, "conv1d")} <= listed
    assert {"lm_head", "mtp.fc"} <= listed
    assert ("model.layers.0.mlp.shared_expert_gate" in listed) == ("moe" in qh.family or "next" in qh.family)


def test_prefill_lengths_and_decode_match_transformers(qh):
    # 70 tokens span two chunks of the chunked delta rule
    check_prefill_and_decode(qh.model, qh.spec, qh.hf, lengths=(1, 13, 70), decode_steps=3, atol=ATOL)


@pytest.mark.parametrize(
    "qh", ENGINE_CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_ENGINE_CASES], indirect=True
)
def test_engine_greedy_equals_transformers_batched_and_solo(qh):
    check_engine_greedy(qh.path, qh.hf)


@pytest.mark.parametrize("qh", ["fp8_block/qwen3_next", "ct_int4_g32/qwen3_5"], indirect=True)
def test_bfloat16_on_cpu_keeps_the_formats_modules_and_serves(qh):
    """bfloat16 (the CPU default): INT4 projections keep the int4 kernel, FP8 ones are dequantised to bfloat16; each
    computes its weight to bfloat16 rounding and the engine serves greedy requests to the end."""
    from tests.engine.model.family_parity import greedy, mixed_prompts, tiny_engine

    model, _ = load_model(str(qh.path), torch.bfloat16, torch.device("cpu"))
    ours, theirs = model.model.layers[0], hf_layers(qh.hf)[0]
    for name, module, weight, quantized in projections(ours, theirs):
        if quantized:
            assert isinstance(module, Int4Linear) == (qh.kind in INT4 and weight.shape[0] % 16 == 0), name
        with torch.inference_mode():
            got = module(torch.eye(weight.shape[1], dtype=torch.bfloat16)).t().float()
        torch.testing.assert_close(got, weight, atol=1e-3, rtol=2**-7, msg=name)
    out = greedy(tiny_engine(qh.path, dtype="bfloat16"), mixed_prompts(), max_tokens=6)
    assert all(len(tokens) == 6 for tokens in out.values())


@pytest.mark.parametrize(
    "kind, model_type", [("awq", "qwen3_next"), ("ct_int4_g32", "qwen3_next"), ("fp8_block", "qwen3_5_text")]
)
def test_quantized_small_projections_are_served_dequantised_exactly(kind, model_type, tmp_path, baked_model_path):
    """A checkpoint that quantizes the small projections too (Qwen3-Next's in_proj_ba: 8 rows here, 2 x num_v_heads,
    fewer than the CPU int4 kernel takes; Qwen3.5's in_proj_a / in_proj_b in FP8: one partial 128-row block) serves
    each as its dequantised weight, and the larger ones as before."""
    hf = write_hybrid_quantized(kind, model_type, tmp_path, quantize=re.compile(r"\.linear_attn\."))
    model, spec = load_family(tmp_path, baked_model_path)
    ours, theirs = model.model.layers[0], hf_layers(hf)[0]
    deltanet = [p for p in projections(ours, theirs) if p[0].startswith(("in_proj", "out_proj"))]
    assert len(deltanet) == (3 if model_type == "qwen3_next" else 5)
    for name, module, weight, _ in deltanet:
        assert isinstance(module, Int4Linear if kind in INT4 and weight.shape[0] % 16 == 0 else nn.Linear), name
        with torch.inference_mode():
            got = module(torch.eye(weight.shape[1])).t()
        torch.testing.assert_close(got, weight, atol=1e-5, rtol=1e-5, msg=name)
    check_prefill_and_decode(model, spec, hf, lengths=(1, 70), decode_steps=2, atol=ATOL)
