"""Quantized multi-head latent attention (MLA) checkpoints at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two
processes): each rank reads its heads' rows of kv_b_proj's FP8 weight and block scales and dequantises them into its
per-head weights, its slices of every other projection and expert in the checkpoint's format. DeepSeek's block FP8
in 8 x 8 blocks (whole blocks on each rank) and compressed-tensors per-channel FP8: against one rank and transformers
on the dequantised weights in float32. Blocks that a rank's heads would cut are refused in one line."""

from __future__ import annotations

import pytest

from engine.model.loader import shard_refusal
from tests.engine.core.distributed.test_tensor_parallel_mla import ATOL, prompts
from tests.engine.core.distributed.tp_models import check_split_answers, child_pids, copy_tokenizer
from tests.engine.core.engine_run import make_engine
from tests.engine.model.family_parity import reference_logits
from tests.engine.model.mla_quant_checkpoints import write_mla_quantized

CASES = {"fp8_block/deepseek_v3": dict(block=(8, 8)), "ct_fp8/glm4_moe_lite": {}}


@pytest.mark.parametrize("case", list(CASES))
def test_split_answers_equal_one_rank_and_transformers(case, tmp_path, baked_model_path):
    kind, family = case.split("/")
    hf = write_mla_quantized(kind, family, tmp_path, **CASES[case])
    copy_tokenizer(tmp_path, baked_model_path)
    kw = dict(page_size=4, num_kv_pages=96, max_num_batched_tokens=16)
    before = child_pids()
    one = make_engine(tmp_path, **kw)
    two = make_engine(tmp_path, tensor_parallel_size=2, **kw)
    try:
        head = two.model.model.layers[0].self_attn.kv_b_proj.weight  # rank 0's two heads of nope 16 + v 12 rows
        assert head.shape == (56, 32) and head.dtype == hf.dtype
        (prompt,) = prompts((22,), seed=4)
        check_split_answers(lambda tokens: reference_logits(hf, tokens), one, two, prompt, 6, atol=ATOL)
    finally:
        two.close()
        one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def test_blocks_a_ranks_heads_would_cut_are_refused_in_one_line(tmp_path):
    """16-row blocks over kv_b_proj's 112 rows: a rank's two heads hold 56 of them."""
    write_mla_quantized("fp8_block", "deepseek_v3", tmp_path, block=(16, 16))
    why = shard_refusal(str(tmp_path), 2)
    assert why is not None and "\n" not in why
    assert why.startswith(
        "tensor_parallel_size=2 would cut fp8's weight_scale_inv of model.layers.0.self_attn.kv_b_proj"
    )
