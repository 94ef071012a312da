"""Quantized mixture-of-experts checkpoints as the hub ships them (Qwen3-30B-A3B's AWQ and FP8): each expert's
gate/up/down is an ordinary AWQ, GPTQ, compressed-tensors W4A16 or FP8 (per-tensor, per-channel, 128 x 128 block)
linear, the routers are left in float. Tiny random Qwen3-MoE (a dense layer among sparse ones) and Mixtral (a
sliding window shorter than the prompts) models in each format load, pass the bake's check, hold each expert's
own weights (INT4 through the CPU int4 kernel, FP8 dequantised) and reproduce transformers running the weights the
checkpoint stands for: logits over prompt lengths and decode steps, greedy through the engine batched and alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.linear import Int4Linear
from engine.model.layers.moe import SparseMoE
from engine.model.layers.routing import ScoreLinear
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_prefill_and_decode,
    greedy,
    load_case,
    mixed_prompts,
    tiny_engine,
)
from tests.engine.model.quant_writers import awq_tensors, write_quantized

INT4 = {"awq", "gptq", "ct_int4"}
FP8 = {"ct_fp8", "ct_fp8_tensor", "fp8_block"}
SIZES = {
    "qwen3_moe": dict(
        num_experts=8, moe_intermediate_size=128, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]
    ),
    "mixtral": dict(num_local_experts=4, intermediate_size=128, sliding_window=12),
}
CASES = [f"{kind}/qwen3_moe" for kind in sorted(INT4 | FP8)] + ["awq/mixtral", "fp8_block/mixtral"]
# NOTE: past loading every INT4 format serves through the same Int4Linear and every FP8 one through the same
# dequantised Linear, so the engine runs (about 30 s each here) cover one of each per family by default.
ENGINE_CASES = ["awq/qwen3_moe", "fp8_block/qwen3_moe", "awq/mixtral"]
ATOL = 2e-4  # float32: the int4 kernel's (code - 8) * s + (8 - z) * s rounds apart from (code - z) * s


def write(kind: str, family: str, path):
    return write_quantized(kind, family, path, num_experts_per_tok=2, **SIZES[family])


@pytest.fixture(scope="module", params=CASES)
def qmoe(request, tmp_path_factory, baked_model_path):
    return load_case(request.param, tmp_path_factory, baked_model_path, write)


def test_bake_check_passes_and_each_expert_holds_its_own_weights(qmoe):
    """Every expert projection is its format's serving module (int4 kernel, or a dequantised Linear) computing
    exactly that expert's dequantised weight; the routers stay float32 ScoreLinears."""
    assert check_checkpoint(str(qmoe.path)) == type(qmoe.hf).__name__
    layers = list(zip(qmoe.model.model.layers, qmoe.hf.model.layers, strict=True))
    flags = [isinstance(ours.mlp, SparseMoE) for ours, _ in layers]
    assert flags == ([True, False, True] if qmoe.family == "qwen3_moe" else [True, True])
    sparse = [(ours.mlp, theirs.mlp) for ours, theirs in layers if isinstance(ours.mlp, SparseMoE)]
    for ours, theirs in sparse:
        assert isinstance(ours.gate, ScoreLinear) and ours.gate.weight.dtype == torch.float32
        assert not hasattr(ours.experts, "gate_up_proj")
        for e, (gate_up, down) in enumerate(ours.experts.linears):
            for module, weight in ((gate_up, theirs.experts.gate_up_proj[e]), (down, theirs.experts.down_proj[e])):
                assert isinstance(module, Int4Linear if qmoe.kind in INT4 else nn.Linear)
                with torch.inference_mode():
                    got = module(torch.eye(weight.shape[1])).t()
                torch.testing.assert_close(got, weight, atol=1e-5, rtol=1e-5, msg=f"expert {e}")


def test_prefill_lengths_and_decode_match_transformers(qmoe):
    # the 30-token prompt crosses pages and, in Mixtral, decodes past its 12-token window
    check_prefill_and_decode(qmoe.model, qmoe.spec, qmoe.hf, lengths=(1, 7, 30), decode_steps=4, atol=ATOL)


@pytest.mark.parametrize("qmoe", ENGINE_CASES, indirect=True)
def test_engine_greedy_equals_transformers_batched_and_solo(qmoe):
    check_engine_greedy(qmoe.path, qmoe.hf)


@pytest.mark.slow
@pytest.mark.parametrize("qmoe", [case for case in CASES if case not in ENGINE_CASES], indirect=True)
def test_engine_greedy_in_the_other_formats(qmoe):
    check_engine_greedy(qmoe.path, qmoe.hf)


def test_bfloat16_on_cpu_keeps_each_experts_weights_and_serves(qmoe):
    """bfloat16 (the CPU default): INT4 experts keep the int4 kernel, FP8 experts are dequantised to bfloat16 (and
    packed for oneDNN where the CPU has it); each computes its expert's weight to bfloat16 rounding, and the engine
    serves greedy requests to the end."""
    model, _ = load_model(str(qmoe.path), torch.bfloat16, torch.device("cpu"))
    layers = zip(model.model.layers, qmoe.hf.model.layers, strict=True)
    pairs = [(ours.mlp.experts, theirs.mlp.experts) for ours, theirs in layers if isinstance(ours.mlp, SparseMoE)]
    for ours, theirs in pairs:
        for e, (gate_up, down) in enumerate(ours.linears):
            for module, weight in ((gate_up, theirs.gate_up_proj[e]), (down, theirs.down_proj[e])):
                assert isinstance(module, Int4Linear) == (qmoe.kind in INT4)
                assert all(t.dtype != torch.float32 for t in [*module.parameters(), *module.buffers()])
                with torch.inference_mode():
                    got = module(torch.eye(weight.shape[1], dtype=torch.bfloat16)).t().float()
                torch.testing.assert_close(got, weight, atol=1e-3, rtol=2**-7, msg=f"expert {e}")
    out = greedy(tiny_engine(qmoe.path, dtype="bfloat16"), mixed_prompts(), max_tokens=6)
    assert all(len(tokens) == 6 for tokens in out.values())


@pytest.fixture(scope="module")
def awq_moe(tmp_path_factory):
    """A tiny AWQ Qwen3-MoE checkpoint: (path, its tensors)."""
    path = tmp_path_factory.mktemp("awq-qwen3-moe")
    write("awq", "qwen3_moe", path)
    return path, load_file(path / "model.safetensors")


def rewrite(awq_moe, tmp_path, change) -> None:
    """A copy of the AWQ checkpoint in tmp_path with change(tensors) applied."""
    source, tensors = awq_moe
    tensors = dict(tensors)
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((source / "config.json").read_text())


def test_the_config_lists_the_routers_as_float(awq_moe):
    config = json.loads((awq_moe[0] / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == [
        "model.layers.0.mlp.gate",
        "model.layers.2.mlp.gate",
    ]


def test_a_quantized_router_fails_the_bake_in_one_line(awq_moe, tmp_path):
    def quantize_router(tensors):
        quantized, _ = awq_tensors(tensors.pop("model.layers.2.mlp.gate.weight").float())
        tensors.update({f"model.layers.2.mlp.gate.{k}": v for k, v in quantized.items()})

    rewrite(awq_moe, tmp_path, quantize_router)
    with pytest.raises(UnsupportedModel, match=r"^awq: the router model\.layers\.2\.mlp\.gate is quantized") as err:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)


def test_an_expert_left_in_float_among_quantized_ones_fails_the_bake(awq_moe, tmp_path):
    def dequantize_expert(tensors):
        for suffix in ("qweight", "qzeros", "scales"):
            tensors.pop(f"model.layers.0.mlp.experts.3.down_proj.{suffix}")
        tensors["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(256, 128)

    rewrite(awq_moe, tmp_path, dequantize_expert)
    with pytest.raises(UnsupportedModel, match=r"experts\.3\.down_proj is not quantized while other experts"):
        check_checkpoint(str(tmp_path))
