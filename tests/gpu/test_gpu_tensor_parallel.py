"""TENSOR_PARALLEL_SIZE=2 on two CUDA devices (NCCL all-reduce, broadcast and gather, FlashInfer per rank) against
one device, on a tiny random Llama in bfloat16: greedy answers equal, prompt log-probabilities close. Skipped on a
machine with fewer than two GPUs (the CPU tests run the same code over gloo)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.core.distributed.tp_models import save_tp_model
from tests.engine.core.engine_run import greedy, make_engine, random_prompts, run

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs 2 GPUs")


def test_two_gpus_answer_as_one(tmp_path, baked_model_path):
    path = save_tp_model("llama_biased", tmp_path, baked_model_path)
    prompts = random_prompts(3, 5, 40, seed=1)
    requests = {f"r{i}": (p, greedy(8, prompt_logprobs=0)) for i, p in enumerate(prompts)}
    results = {}
    for size in (1, 2):
        engine = make_engine(path, device="cuda", dtype="bfloat16", tensor_parallel_size=size)
        try:
            results[size] = run(engine, requests)
        finally:
            engine.close()
    for rid in requests:
        one, two = results[1][rid], results[2][rid]
        assert one.choices[0].token_ids == two.choices[0].token_ids
        first = [p.chosen.logprob for p in one.first.prompt_logprobs[1:]]
        second = [p.chosen.logprob for p in two.first.prompt_logprobs[1:]]
        assert second == pytest.approx(first, abs=0.1)  # bf16: the ranks round partial sums before adding
