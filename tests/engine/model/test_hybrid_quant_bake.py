"""What the bake keeps and refuses of a quantized hybrid checkpoint: each format bakes through `python -m builder`
on a local folder (the quantized multi-token-prediction weights kept, unread) and serves transformers' tokens on the
dequantised weights; a checkpoint that quantizes what the engine runs in float, or whose tensors a format cannot
hold (inputs in partial groups, 4 rows packed 8 to a word, a config disagreeing with its tensors), fails the check
in one line naming the module."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from builder.__main__ import main as builder_main
from engine.errors import UnsupportedModel
from engine.model.loader import check_checkpoint
from tests.engine.model.family_parity import greedy, hf_greedy, tiny_engine
from tests.engine.model.hybrid_quant_checkpoints import write_hybrid_quantized
from tests.engine.model.test_hybrid_bake import _with_tokenizer


@pytest.mark.parametrize(
    "kind, model_type",
    [("fp8_block", "qwen3_5"), ("awq", "qwen3_next"), ("ct_int4", "qwen3_5_moe_text"), ("ct_int4_g32", "qwen3_5")],
)
def test_each_format_bakes_keeps_mtp_and_serves_transformers_tokens(kind, model_type, tmp_path, baked_model_path):
    src, out = tmp_path / "src", tmp_path / "baked"
    hf = write_hybrid_quantized(kind, model_type, src)
    _with_tokenizer(src, baked_model_path)
    assert builder_main(["--model", str(src), "--out", str(out)]) == 0
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
        == json.loads((src / "config.json").read_text())["quantization_config"]["quant_method"]
    )
    mtp = [
        {k for k in safe_open(str(folder / "model.safetensors"), "pt").keys() if k.startswith("mtp.")}
        for folder in (src, out)
    ]
    assert mtp[0] == mtp[1] and "mtp.fc.weight" in mtp[1] and len(mtp[1]) > 2  # its quantized projection's tensors
    prompt = torch.randint(3, 128, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    assert greedy(tiny_engine(out), {"p": prompt}, 6)["p"] == hf_greedy(hf, prompt, 6)


def rewrite(path, change_tensors=None, change_config=None) -> None:
    tensors = load_file(path / "model.safetensors")
    if change_tensors is not None:
        change_tensors(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if change_config is not None:
        config = json.loads((path / "config.json").read_text())
        change_config(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))


def refused(path, pattern: str) -> None:
    with pytest.raises(UnsupportedModel, match=pattern) as err:
        check_checkpoint(str(path))
    assert "\n" not in str(err.value)


def test_a_quantized_shared_expert_gate_fails_the_check(tmp_path):
    write_hybrid_quantized(
        "ct_int4_g32", "qwen3_5_moe_text", tmp_path, quantize=re.compile(r"shared_expert_gate$|\.experts\.")
    )
    refused(
        tmp_path,
        r"^compressed-tensors pack-quantized: the shared-expert gate "
        r"model\.layers\.0\.mlp\.shared_expert_gate is quantized in this checkpoint",
    )


def test_a_quantized_conv1d_fails_the_check_naming_it(tmp_path):
    """The DeltaNet's depthwise conv is not a linear: a block-FP8 conv1d (weight and weight_scale_inv) is named, not
    reported as an unexpected scale tensor."""
    write_hybrid_quantized("fp8_block", "qwen3_5_text", tmp_path)

    def quantize_conv(tensors):
        name = "model.layers.1.linear_attn.conv1d"
        weight = tensors.pop(f"{name}.weight")
        tensors[f"{name}.weight"] = weight.to(torch.float8_e4m3fn)
        tensors[f"{name}.weight_scale_inv"] = torch.ones(-(-weight.shape[0] // 128), 1)

    rewrite(tmp_path, quantize_conv)
    refused(
        tmp_path,
        r"^fp8: model\.layers\.1\.linear_attn\.conv1d is quantized in this checkpoint; the engine runs "
        r"it unquantized",
    )


def test_inputs_in_partial_groups_fail_the_check(tmp_path):
    """Group 96 over 256 inputs: neither the format's writers nor torch's int4 kernels take a partial last group."""
    write_hybrid_quantized("ct_int4_g32", "qwen3_5_text", tmp_path)
    rewrite(tmp_path, change_config=lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=96))
    # The first such linear the model holds is named: the DeltaNet's out_proj and in_proj_qkv both take 256 inputs.
    refused(
        tmp_path,
        r"^compressed-tensors pack-quantized: model\.layers\.0\.linear_attn\.(out_proj|in_proj_qkv) has 256 "
        r"inputs, not whole groups of 96$",
    )


def test_a_config_group_that_disagrees_with_the_tensors_fails_the_check(tmp_path):
    write_hybrid_quantized("ct_int4", "qwen3_next", tmp_path)  # written in groups of 128
    rewrite(tmp_path, change_config=lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=64))
    refused(
        tmp_path,
        r"^compressed-tensors pack-quantized: model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight_scale "
        r"has shape \(128, 2\), expected \(128, 4\) for a 256 -> 128 linear$",
    )


def test_an_awq_in_proj_b_of_4_rows_fails_the_check(tmp_path):
    """AWQ packs 8 output rows to a word: Qwen3.5's in_proj_b has num_v_heads rows (4 in this tiny model; 16 to 64
    in the real ones, which leave it in float anyway)."""
    write_hybrid_quantized("awq", "qwen3_5_text", tmp_path)

    def quantize_b(tensors):
        name = "model.layers.0.linear_attn.in_proj_b"
        tensors.pop(f"{name}.weight")
        tensors.update(
            {
                f"{name}.qweight": torch.zeros(256, 1, dtype=torch.int32),
                f"{name}.qzeros": torch.zeros(2, 1, dtype=torch.int32),
                f"{name}.scales": torch.ones(2, 4, dtype=torch.float16),
            }
        )

    rewrite(tmp_path, quantize_b)
    refused(tmp_path, r"^awq: model\.layers\.0\.linear_attn\.in_proj_b has 4 output rows; awq packs them 8 to a word$")
