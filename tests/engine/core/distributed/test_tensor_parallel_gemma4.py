"""A Gemma4ForConditionalGeneration checkpoint (vision tower, per-layer inputs, global layers of their own head size)
at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): it serves its text model, as one rank and transformers do
on text, and takes no images (its vision tower is not loaded: a rank gets token ids, not rank 0's image embeddings).
Gemma 4 text's own parity at TP=2 (shared KV, double-wide MLP, the MoE block) is tp_models.py's gemma4_text."""

from __future__ import annotations

import torch

from tests.engine.core.distributed.tp_models import check_split_answers, child_pids
from tests.engine.core.engine_run import make_engine
from tests.engine.model.gemma4_vision_checkpoint import BOI, build_gemma4_vision, hf_logits


def test_its_text_model_answers_as_one_rank_and_transformers_and_takes_no_images(tmp_path, baked_model_path):
    hf = build_gemma4_vision(tmp_path, baked_model_path)
    before = child_pids()
    one, two = make_engine(tmp_path), make_engine(tmp_path, tensor_parallel_size=2)
    try:
        assert one.spec.vision is not None and two.spec.vision is None
        assert not hasattr(two.model, "vision_tower")
        prompt = torch.randint(3, BOI, (21,), generator=torch.Generator().manual_seed(1)).tolist()
        check_split_answers(lambda tokens: hf_logits(hf, tokens, []), one, two, prompt, 6, vocab=BOI)
    finally:
        two.close()
        one.close()
    assert child_pids() <= before, "a rank outlived its engine"
