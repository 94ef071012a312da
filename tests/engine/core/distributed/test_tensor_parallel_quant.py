"""Quantized checkpoints at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): AWQ, GPTQ, compressed-tensors
int4 and FP8, and block FP8 (128 x 128 scales, K and V of one 64-row head inside a block), each in its packed form
(quant_writers.py), and an AWQ mixture of experts (a W4A16 hybrid: test_tensor_parallel_quant_hybrid.py). Each rank
reads its slices of the packed tensors only: column-parallel linears by output rows (whole pack words), row-parallel
ones by inputs in whole groups and blocks, and holds exactly those columns of the full model's weights; the answers
match one rank and transformers. A size that would cut a group or block is refused in one line naming the numbers,
before any rank starts."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from engine.config import EngineConfig
from engine.core.distributed.ranks import rank_config
from engine.core.engine import LLMEngine
from engine.errors import StartupError
from engine.model.layers.parallel import TensorParallel
from engine.model.loader import load_model
from tests.engine.core.distributed.tp_models import check_split_answers, child_pids, copy_tokenizer
from tests.engine.core.engine_run import make_engine
from tests.engine.model.family_parity import reference_logits
from tests.engine.model.quant_writers import TINY, write_quantized

CASES = ["awq/llama", "gptq/qwen3", "ct_int4/llama", "ct_fp8/qwen3", "fp8_block/llama", "awq/qwen3_moe"]
# A Qwen3-MoE whose experts' 256 columns leave a rank 128 inputs of down_proj: one whole AWQ group.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[1])
# What a size of 4 is refused with (a rank would hold 64 inputs of o_proj, or of an expert's down_proj); None: 4 ranks
# split it (per-channel FP8 scales: nothing to cut along the inputs).
O_PROJ = "of model.layers.0.self_attn.o_proj (128 inputs an entry): a rank holds 64 inputs from 192"
AT_FOUR = {
    "awq/llama": f"awq's qzeros {O_PROJ}",
    "gptq/qwen3": f"gptq's qzeros {O_PROJ}",
    "ct_int4/llama": f"compressed-tensors pack-quantized's weight_scale {O_PROJ}",
    "ct_fp8/qwen3": None,
    "fp8_block/llama": f"fp8's weight_scale_inv {O_PROJ}",
    "awq/qwen3_moe": "awq's qzeros of model.layers.0.mlp.experts.0.down_proj (128 inputs an entry): a rank holds 64 "
    "inputs from 192",
}


@pytest.fixture(scope="module", params=CASES)
def tp_quant(request, tmp_path_factory, baked_model_path):
    """(case, transformers model, TP=1 engine, TP=2 engine, path) over one quantized checkpoint."""
    kind, family = request.param.split("/")
    path = tmp_path_factory.mktemp(f"{kind}-{family}")
    hf = write_quantized(kind, family, path, **(MOE if family == "qwen3_moe" else {}))
    copy_tokenizer(path, baked_model_path)
    before = child_pids()
    one, two = make_engine(path), make_engine(path, tensor_parallel_size=2)
    assert len(child_pids() - before) == 1  # rank 1
    yield request.param, hf, one, two, path
    two.close()
    one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def weight(module: torch.nn.Module) -> torch.Tensor:
    """The [out, in] float32 weight a serving linear multiplies by (the int4 kernel's, through the identity)."""
    with torch.no_grad():
        return module(torch.eye(module.in_features)).t()


def test_each_rank_holds_exactly_its_columns_of_the_weights(tp_quant):
    _, _, _, _, path = tp_quant
    full = load_model(str(path), torch.float32, torch.device("cpu"))[0].model.layers[0]
    q, kv = 2 * 64, 64  # a rank's q rows (2 heads of 64), k and v rows (1 KV head)
    for rank in range(2):
        part = load_model(str(path), torch.float32, torch.device("cpu"), tp=TensorParallel(rank, 2))[0].model.layers[0]
        qkv = weight(full.self_attn.qkv_proj).split([2 * q, 2 * kv, 2 * kv])
        expected = torch.cat([m[rank * n : (rank + 1) * n] for m, n in zip(qkv, (q, kv, kv), strict=True)])
        torch.testing.assert_close(weight(part.self_attn.qkv_proj), expected, atol=0, rtol=0)
        torch.testing.assert_close(
            weight(part.self_attn.o_proj), weight(full.self_attn.o_proj)[:, rank * q :][:, :q], atol=0, rtol=0
        )
        if hasattr(full.mlp, "down_proj"):
            n = TINY["intermediate_size"] // 2
            gate, up = weight(full.mlp.gate_up_proj).chunk(2)
            torch.testing.assert_close(
                weight(part.mlp.gate_up_proj), torch.cat([gate[rank * n :][:n], up[rank * n :][:n]]), atol=0, rtol=0
            )
            torch.testing.assert_close(
                weight(part.mlp.down_proj), weight(full.mlp.down_proj)[:, rank * n :][:, :n], atol=0, rtol=0
            )
        else:  # each expert's gate|up rows and down inputs of this rank
            n = MOE["moe_intermediate_size"] // 2
            (gate_up, down), (full_gate_up, full_down) = part.mlp.experts.linears[3], full.mlp.experts.linears[3]
            gate, up = weight(full_gate_up).chunk(2)
            torch.testing.assert_close(
                weight(gate_up), torch.cat([gate[rank * n :][:n], up[rank * n :][:n]]), atol=0, rtol=0
            )
            torch.testing.assert_close(weight(down), weight(full_down)[:, rank * n :][:, :n], atol=0, rtol=0)


def test_prompt_logprobs_and_greedy_match_one_rank_and_transformers(tp_quant):
    _, hf, one, two, _ = tp_quant
    prompt = torch.randint(3, TINY["vocab_size"], (23,), generator=torch.Generator().manual_seed(1)).tolist()
    check_split_answers(partial(reference_logits, hf), one, two, prompt, 6)


def test_a_size_that_cuts_a_group_is_refused_before_any_rank_starts(tp_quant):
    case, _, _, _, path = tp_quant
    config = EngineConfig(model_path=str(path), dtype="float32", tensor_parallel_size=4)
    if AT_FOUR[case] is None:
        assert rank_config(config, torch.device("cpu")).tensor_parallel_size == 4
        return
    before = child_pids()
    with pytest.raises(StartupError) as info:
        LLMEngine(config)
    assert info.value.message == f"tensor_parallel_size=4 would cut {AT_FOUR[case]}"
    assert child_pids() <= before
