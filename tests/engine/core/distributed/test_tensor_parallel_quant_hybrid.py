"""A quantized hybrid at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): a compressed-tensors W4A16
Qwen3.5-MoE whose ranks read three spans of DeltaNet q|k|v rows, and a block-FP8 Qwen3.5 whose 64-row key parts would
leave half blocks side by side in a rank's q|k|v, refused in one line. (A module of its own: one process holds one
tensor-parallel engine at a time, and test_tensor_parallel_quant.py's fixture holds its engines for the module.)"""

from __future__ import annotations

from functools import partial

import torch

from engine.model.loader import shard_refusal
from tests.engine.core.distributed.tp_models import check_split_answers, child_pids, copy_tokenizer
from tests.engine.model.family_parity import reference_logits, tiny_engine
from tests.engine.model.hybrid_quant_checkpoints import write_hybrid_quantized


def test_a_quantized_hybrid_splits_its_deltanet_heads_in_whole_groups(tmp_path, baked_model_path):
    """A compressed-tensors W4A16 Qwen3.5-MoE (groups of 32): a rank's DeltaNet q|k|v rows are three spans of the
    packed tensors, its experts and shared expert their columns; it answers as one rank and transformers do."""
    hf = write_hybrid_quantized("ct_int4_g32", "qwen3_5_moe_text", tmp_path, moe_intermediate_size=256)
    copy_tokenizer(tmp_path, baked_model_path)
    before = child_pids()
    one, two = tiny_engine(tmp_path), tiny_engine(tmp_path, tensor_parallel_size=2)
    try:
        prompt = torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(1)).tolist()
        check_split_answers(partial(reference_logits, hf), one, two, prompt, 4)
    finally:
        two.close()
        one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def test_block_fp8_parts_side_by_side_must_be_whole_blocks(tmp_path):
    """A DeltaNet q|k|v of 64-row key parts: a rank's three parts would share one block grid, so half blocks are
    refused (a KV head inside one block is whole only as a matrix of its own); 128-row key heads split."""
    write_hybrid_quantized("fp8_block", "qwen3_5_text", tmp_path / "half")
    assert shard_refusal(str(tmp_path / "half"), 2) == (
        "tensor_parallel_size=2 would cut fp8's weight_scale_inv of model.layers.0.linear_attn.in_proj_qkv (128 output "
        "rows an entry): a rank holds 64 output rows from 64"
    )
    write_hybrid_quantized("fp8_block", "qwen3_5_text", tmp_path / "whole", linear_key_head_dim=128)
    assert shard_refusal(str(tmp_path / "whole"), 2) is None
