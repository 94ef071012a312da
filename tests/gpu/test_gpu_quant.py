"""Quantized linears on CUDA against the float32 dequantisation reference: AWQ and GPTQ weights repacked for
torch's tinygemm int4 kernel (bfloat16), FP8 weights kept in FP8 through torch._scaled_mm (sm89+), and tiny AWQ
and FP8 checkpoints loaded onto the GPU."""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.quant.awq import AwqFormat
from engine.model.quant.gptq import GptqFormat
from engine.model.quant.int4 import TinygemmInt4Linear
from tests.engine.model.quant_writers import awq_tensors, checkpoint_linear, gptq_tensors, write_quantized


@pytest.mark.parametrize("kind", ["awq", "gptq"])
def test_tinygemm_int4_matches_the_dequantised_weight(kind: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(384, 512) * 0.1
    tensors, reference = awq_tensors(w) if kind == "awq" else gptq_tensors(w, symmetric=False)
    fmt = AwqFormat(128) if kind == "awq" else GptqFormat(128, zeros_minus_one=True)
    module = fmt.serving_module(checkpoint_linear(fmt, tensors, 512, 384), torch.bfloat16, torch.device("cuda"))
    assert isinstance(module, TinygemmInt4Linear)
    x = torch.randn(7, 512, device="cuda").bfloat16()
    expected = x.float() @ reference.cuda().t()
    # bfloat16 activations, scales and output: within a few bfloat16 steps of the float32 product.
    torch.testing.assert_close(module(x).float(), expected, atol=0.05, rtol=0.02)


def test_an_awq_checkpoint_serves_on_the_gpu_through_tinygemm(tmp_path) -> None:
    hf = write_quantized("awq", "llama", tmp_path)
    model, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cuda"))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, TinygemmInt4Linear)
    x = torch.randn(3, 512, device="cuda").bfloat16()
    expected = x.float() @ hf.model.layers[0].mlp.down_proj.weight.detach().cuda().t()
    torch.testing.assert_close(layer.mlp.down_proj(x).float(), expected, atol=0.05, rtol=0.02)


def _fp8_capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("row_wise", [False, True])
def test_fp8_weights_stay_fp8_through_scaled_mm(strategy: str, row_wise: bool) -> None:
    """FP8 weights (q|k|v stacked with a scale each, or per channel) through torch._scaled_mm against the float32
    product of the dequantised weight; per-tensor activation scales (Ada) and per-token ones (Hopper+)."""
    from engine.model.quant.fp8_linear import FP8, Fp8Linear
    from tests.engine.model.quant_writers import fp8_stacked_linear

    if _fp8_capability() < ((9, 0) if row_wise else (8, 9)):
        pytest.skip(f"needs compute capability {'9.0' if row_wise else '8.9'} for this FP8 matmul")
    fmt, linear = fp8_stacked_linear(strategy, {"q_proj": 256, "k_proj": 64, "v_proj": 64}, 512)
    module = fmt.serving_module(linear, torch.bfloat16, torch.device("cuda"))
    assert isinstance(module, Fp8Linear) and module.weight.dtype == FP8
    module.row_wise = row_wise
    x = torch.randn(9, 512, device="cuda").bfloat16()
    expected = x.float() @ fmt.dequantize(linear).cuda().t()
    # e4m3 activations (3 mantissa bits) and a bfloat16 output: within a few percent of the float32 product.
    assert float((module(x).float() - expected).norm() / expected.norm()) < 0.04


def test_an_fp8_checkpoint_serves_on_the_gpu_in_fp8(tmp_path) -> None:
    from engine.model.quant.fp8_linear import Fp8Linear

    if _fp8_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9 for an FP8 matmul")
    hf = write_quantized("ct_fp8", "llama", tmp_path)
    model, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cuda"))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8Linear) and isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    x = torch.randn(3, 512, device="cuda").bfloat16()
    expected = x.float() @ hf.model.layers[0].mlp.down_proj.weight.detach().cuda().t()
    assert float((layer.mlp.down_proj(x).float() - expected).norm() / expected.norm()) < 0.04
