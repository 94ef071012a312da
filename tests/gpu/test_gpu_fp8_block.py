"""Block-wise FP8 weights on Hopper through the block-scaled GEMM (engine/model/quant/fp8_block_linear.py) against
the float32 product of the dequantised weight: a tiny block-FP8 checkpoint loaded onto the GPU, token counts that
need padding to a multiple of 4, a stacked q|k|v with 64-row K and V kept dequantised, and a CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.quant.fp8_block_linear import Fp8BlockLinear, block_gemm_runs
from tests.engine.model.quant_writers import write_quantized

CUDA = torch.device("cuda")


def needs_hopper() -> None:
    if not block_gemm_runs(CUDA, torch.bfloat16):
        pytest.skip("the block-scaled FP8 GEMM runs on sm90 with torch.nn.functional.scaled_mm")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("tokens", [1, 3, 5, 130])
def test_a_block_fp8_checkpoint_serves_in_fp8(tokens, tmp_path):
    needs_hopper()
    hf = write_quantized("fp8_block", "llama", tmp_path)
    model, _ = load_model(str(tmp_path), torch.bfloat16, CUDA)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8BlockLinear) and isinstance(layer.self_attn.qkv_proj, Fp8BlockLinear)
    reference = hf.model.layers[0]
    x = torch.randn(tokens, 512, device="cuda").bfloat16()
    expected = x.float() @ reference.mlp.down_proj.weight.detach().cuda().t()
    # e4m3 activations per 128 columns (3 mantissa bits) and a bfloat16 output: a few percent of the product.
    assert relative_error(layer.mlp.down_proj(x), expected) < 0.04
    h = torch.randn(tokens, 256, device="cuda").bfloat16()
    q = h.float() @ reference.self_attn.q_proj.weight.detach().cuda().t()
    assert relative_error(layer.self_attn.qkv_proj(h)[:, :256], q) < 0.04


def test_k_and_v_smaller_than_a_block_stay_dequantised(tmp_path):
    needs_hopper()
    write_quantized("fp8_block", "llama", tmp_path, num_key_value_heads=1)
    model, _ = load_model(str(tmp_path), torch.bfloat16, CUDA)
    layer = model.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, Fp8BlockLinear)
    assert isinstance(layer.mlp.gate_up_proj, Fp8BlockLinear)


def test_the_block_gemm_replays_in_a_cuda_graph(tmp_path):
    needs_hopper()
    write_quantized("fp8_block", "llama", tmp_path)
    model, _ = load_model(str(tmp_path), torch.bfloat16, CUDA)
    down = model.model.layers[0].mlp.down_proj
    x = torch.randn(8, 512, device="cuda").bfloat16()
    with torch.inference_mode():
        down(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = down(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, down(x))
