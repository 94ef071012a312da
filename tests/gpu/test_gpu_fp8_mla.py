"""DeepSeek-V3's block FP8 release format (128 x 128 blocks) on Hopper: a tiny MLA model's whole-block projections
(q_a_proj, o_proj, every expert) run through the block-scaled GEMM, q_b_proj (96 rows, not whole blocks) stays
dequantised, kv_b_proj is dequantised to bfloat16 into the per-head weights, and the engine serves it on the GPU."""

from __future__ import annotations

import torch

from engine.model.loader import load_model
from engine.model.quant.fp8_block_linear import Fp8BlockLinear
from tests.engine.model.family_parity import greedy, mixed_prompts, tiny_engine
from tests.engine.model.mla_quant_checkpoints import write_mla_quantized
from tests.engine.model.test_hybrid_bake import _with_tokenizer
from tests.gpu.test_gpu_fp8_block import CUDA, needs_hopper, relative_error

SIZES = dict(
    hidden_size=256,
    q_lora_rank=128,
    kv_lora_rank=128,
    v_head_dim=32,
    intermediate_size=256,
    moe_intermediate_size=128,
)


def test_deepseeks_fp8_release_keeps_whole_block_projections_in_fp8(tmp_path, baked_model_path):
    needs_hopper()
    hf = write_mla_quantized("fp8_block", "deepseek_v3", tmp_path, block=(128, 128), **SIZES)
    model, _ = load_model(str(tmp_path), torch.bfloat16, CUDA)
    ours, theirs = model.model.layers[1].self_attn, hf.model.layers[1].self_attn
    assert isinstance(ours.q_a_proj, Fp8BlockLinear) and isinstance(ours.o_proj, Fp8BlockLinear)
    assert not isinstance(ours.q_b_proj, Fp8BlockLinear)
    assert all(isinstance(m, Fp8BlockLinear) for pair in model.model.layers[1].mlp.experts.linears for m in pair)
    expected = theirs.kv_b_proj.weight.detach().to(CUDA, torch.bfloat16)
    assert ours.kv_b_proj.weight.dtype == torch.bfloat16 and torch.equal(ours.kv_b_proj.weight, expected)
    x = torch.randn(5, 256, device="cuda").bfloat16()
    # e4m3 activations per 128 columns (3 mantissa bits) and a bfloat16 output: a few percent of the product.
    assert relative_error(ours.q_a_proj(x), x.float() @ theirs.q_a_proj.weight.detach().cuda().t()) < 0.04
    _with_tokenizer(tmp_path, baked_model_path)
    out = greedy(tiny_engine(tmp_path, dtype="bfloat16"), mixed_prompts(), max_tokens=6)
    assert all(len(tokens) == 6 for tokens in out.values())
