"""A Gemma4ForConditionalGeneration checkpoint (vision tower, per-layer inputs, global layers of their own head size)
at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): it serves its text model, as one rank and transformers do
on text, and takes no images (its vision tower is not loaded: a rank gets token ids, not rank 0's image embeddings).
Gemma 4 text's own parity at TP=2 (shared KV, double-wide MLP, the MoE block) is tp_models.py's gemma4_text."""

from __future__ import annotations

import pytest
import torch

from engine.sample.params import SamplingParams
from tests.engine.core.distributed.tp_models import child_pids
from tests.engine.core.engine_run import make_engine, run
from tests.engine.model.gemma4_vision_checkpoint import build_gemma4_vision, hf_logits

ATOL = 2e-4


def test_its_text_model_answers_as_one_rank_and_transformers_and_takes_no_images(tmp_path, baked_model_path):
    hf = build_gemma4_vision(tmp_path, baked_model_path)
    before = child_pids()
    one, two = make_engine(tmp_path), make_engine(tmp_path, tensor_parallel_size=2)
    try:
        assert one.spec.vision is not None and two.spec.vision is None
        assert not hasattr(two.model, "vision_tower")
        prompt = torch.randint(3, 97, (21,), generator=torch.Generator().manual_seed(1)).tolist()
        requests = {"p": (prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0))}
        split, single = run(two, requests)["p"], run(one, requests)["p"]
        ref = torch.log_softmax(hf_logits(hf, prompt, []), dim=-1)
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
        got = [p.chosen.logprob for p in split.first.prompt_logprobs[1:]]
        assert got == pytest.approx(expected, abs=ATOL)
        assert got == pytest.approx([p.chosen.logprob for p in single.first.prompt_logprobs[1:]], abs=ATOL)
        assert split.choices[0].token_ids == single.choices[0].token_ids
        tokens = list(prompt)
        for _ in range(6):
            tokens.append(int(hf_logits(hf, tokens, [])[-1].argmax()))
        assert split.choices[0].token_ids == tokens[len(prompt) :]
    finally:
        two.close()
        one.close()
    assert child_pids() <= before, "a rank outlived its engine"
