"""A Gemma4ForConditionalGeneration checkpoint (vision tower, per-layer inputs, global layers of their own head size,
an image's tokens seeing each other both ways on the windowed layers) at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two
processes): rank 0 alone holds the tower and sends each step's image rows and embeddings. Its text answers as one
rank and transformers; a prompt with one image and one with two of different sizes, batched with a text-only one,
answer as one rank; the other rank reads no tower weight. Gemma 4 text's own parity at TP=2 (shared KV, double-wide
MLP, the MoE block) is tp_models.py's gemma4_text."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers.parallel import TensorParallel
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.core.distributed.tp_models import check_split_answers, child_pids
from tests.engine.core.engine_run import make_engine
from tests.engine.model.gemma4_vision_checkpoint import BOI, build_gemma4_vision, hf_logits, prompt_with
from tests.engine.model.vision_checkpoints import image_file, images

ATOL = 2e-4  # log-probabilities, float32: the ranks sum the same products in another order
FILES = [image_file(40, 90, 1), image_file(120, 60, 2, "JPEG")]


def _answers(engine, requests: dict[str, tuple[list[int], list[bytes]]]) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    for r, (prompt, files) in requests.items():
        engine.add_request(r, prompt, params, images(files))
    out: dict[str, tuple[list[int], list[float]]] = {r: ([], []) for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.outputs[0].token_ids)
            out[o.request_id][1].extend(p.chosen.logprob for p in o.outputs[0].logprobs or [])
    return out


def test_text_and_images_answer_as_one_rank_and_only_rank_0_reads_the_tower(tmp_path, baked_model_path):
    hf = build_gemma4_vision(tmp_path, baked_model_path)
    before = child_pids()
    one, two = make_engine(tmp_path), make_engine(tmp_path, tensor_parallel_size=2)
    try:
        assert one.spec.vision is not None and two.spec.vision is not None
        prompt = torch.randint(3, BOI, (21,), generator=torch.Generator().manual_seed(1)).tolist()
        check_split_answers(lambda tokens: hf_logits(hf, tokens, []), one, two, prompt, 6, vocab=BOI)
        requests = {
            "one": (prompt_with(FILES[:1], seed=1), FILES[:1]),
            "two": (prompt_with(FILES, seed=2), FILES),
            "text": (prompt_with([], seed=3, lead=9), []),
        }
        encoded = two.runner.num_images_encoded
        single, split = _answers(one, requests), _answers(two, requests)
        assert two.runner.num_images_encoded - encoded == 3
        for r in requests:
            assert split[r][0] == single[r][0], r
            assert split[r][1] == pytest.approx(single[r][1], abs=ATOL), r
    finally:
        two.close()
        one.close()
    assert child_pids() <= before, "a rank outlived its engine"
    rank1, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"), tp=TensorParallel(1, 2))
    assert not [n for n, _ in rank1.named_parameters() if n.startswith(("vision_tower.", "embed_vision."))]
