"""Quantized linears on CUDA against the float32 dequantisation reference: AWQ and GPTQ weights repacked for
torch's tinygemm int4 kernel (bfloat16), and a tiny AWQ checkpoint loaded onto the GPU."""

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
