"""TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes) for the decoders that differ from Llama by a mechanism or
two (tests/engine/model/test_llama_variants_parity.py): Seed-OSS's biases, SmolLM3's no-rotary layers, OLMo 2's norms
after each block with q / k norms over the whole projection (a mean square over every rank's heads), OLMo 3's rope
per layer type, EXAONE 4's per-head norms and no-rotary global layers, Granite's multipliers (and its MoE with a
shared MLP, from the hub's names), Phi-3's fused q|k|v and gate|up checkpoint tensors (each rank reads its heads'
rows of each part), ERNIE 4.5's interleaved rotary and its MoE, Ministral 3's query scaling, Phi-3.5-MoE's LayerNorms
and lm_head bias (each rank's vocabulary rows of it). The prompt's
log-probabilities and greedy answers against one rank and transformers."""

from __future__ import annotations

import pytest
import torch

from tests.engine.core.distributed.tp_models import check_split_answers, child_pids, copy_tokenizer
from tests.engine.core.engine_run import make_engine
from tests.engine.model.test_llama_variants_parity import build_variant

KINDS = (
    "seed_oss",
    "smollm3",
    "olmo2",
    "olmo3",
    "exaone4",
    "granite",
    "phi3",
    "ernie4_5",
    "ministral3",
    "granitemoeshared",
    "ernie4_5_moe",
    "phimoe",
)


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_match_one_rank_and_transformers(kind, tmp_path, baked_model_path):
    hf = build_variant(kind, tmp_path)
    copy_tokenizer(tmp_path, baked_model_path)
    before = child_pids()
    one, two = make_engine(tmp_path, page_size=4), make_engine(tmp_path, page_size=4, tensor_parallel_size=2)
    try:

        def reference(tokens: list[int]) -> torch.Tensor:
            with torch.no_grad():
                return hf(torch.tensor([tokens])).logits[0].float()

        check_split_answers(reference, one, two, prompt=list(range(3, 30)), max_tokens=8)
    finally:
        two.close()
        one.close()
    assert child_pids() <= before, "a rank outlived its engine"
