"""TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes) for image-text checkpoints, tiny random float32: Qwen2.5-VL
(the windowed tower, contiguous 3-D rotary sections), Qwen3-VL dense and MoE (3-D positions, deepstack features; the
MoE's experts in the hub's [E, in, out] layout), Qwen3.5 dense and MoE (the hybrid decoder), Gemma 3 (an image's
tokens see each other both ways) and Mistral 3 (Pixtral's rows of image tokens with a break token after each, cut
across chunks). Rank 0 alone holds the vision tower and sends each step's image rows and embeddings. Against one
rank: the prompt's log-probabilities and greedy answers of a prompt with one image and one with two of different
sizes, batched with a text-only request over chunked prefill (a Qwen image cut across chunks, still encoded once); a
prefix-cache hit of the same image equal to the cold run; the other rank reads no tower weight; no rank is left
behind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.layers.parallel import TensorParallel
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.core.distributed.tp_models import child_pids
from tests.engine.model import mistral3_checkpoint, qwen_vl_checkpoints, vision_checkpoints
from tests.engine.model.family_parity import tiny_engine
from tests.engine.model.vision_checkpoints import image_file, images

ATOL = 2e-4  # log-probabilities, float32: the ranks sum the same products in another order
FILES = [image_file(40, 90, 1), image_file(120, 60, 2, "JPEG")]  # Qwen: 12 and 10 soft tokens; Gemma 3: 16 each
# Mistral 3's prompts for the first n FILES: one image token each, as its chat template writes them
MISTRAL3 = SimpleNamespace(
    prompt_with=lambda n, seed=0, lead=5: mistral3_checkpoint.prompt_with(FILES[:n], seed=seed, lead=lead, widen=False)
)
# family -> (its checkpoint module, the step budget: a Qwen image is cut across chunks, a Gemma 3 one never is)
FAMILIES = {
    "qwen2_5_vl": (qwen_vl_checkpoints, 8),
    "qwen3_vl": (qwen_vl_checkpoints, 8),
    "qwen3_vl_moe": (qwen_vl_checkpoints, 8),
    "qwen3_5": (qwen_vl_checkpoints, 8),
    "qwen3_5_moe": (qwen_vl_checkpoints, 8),
    "gemma3": (vision_checkpoints, 24),
    "mistral3": (MISTRAL3, 8),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tp_vision(request, tmp_path_factory, baked_model_path):
    """The family's checkpoint module, its path, and a TP=1 and a TP=2 engine over it."""
    checkpoints, budget = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    if checkpoints is qwen_vl_checkpoints:
        checkpoints.build_qwen_vl(request.param, path, baked_model_path)
    elif checkpoints is MISTRAL3:
        mistral3_checkpoint.build_mistral3(path, baked_model_path)
    else:
        checkpoints.build_vision_model(path, baked_model_path)
    before = child_pids()
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=32)
    one, two = tiny_engine(path, **kw), tiny_engine(path, tensor_parallel_size=2, **kw)
    assert len(child_pids() - before) == 1  # rank 1
    yield SimpleNamespace(name=request.param, checkpoints=checkpoints, path=path, one=one, two=two)
    two.close()
    one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def _run(engine, requests: dict[str, tuple[list[int], list[bytes]]], params: SamplingParams) -> dict:
    """Each request's outputs: tokens, their logprobs, prompt logprobs and cached prompt tokens."""
    for r, (prompt, files) in requests.items():
        engine.add_request(r, prompt, params, images(files))
    out = {r: SimpleNamespace(tokens=[], logprobs=[], prompt=None, cached=0) for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            res = out[o.request_id]
            res.tokens += o.outputs[0].token_ids
            res.logprobs += [p.chosen.logprob for p in o.outputs[0].logprobs or []]
            res.prompt = res.prompt or o.prompt_logprobs
            res.cached = o.num_cached_tokens
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    return out


def test_prompt_logprobs_and_greedy_answers_match_one_rank(tp_vision):
    prompt_with = tp_vision.checkpoints.prompt_with
    requests = {
        "one": (prompt_with(1, seed=1), FILES[:1]),
        "two": (prompt_with(2, seed=2), FILES),
        "text": (prompt_with(0, seed=3, lead=9), []),
    }
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    encoded = tp_vision.two.runner.num_images_encoded
    single, split = _run(tp_vision.one, requests, params), _run(tp_vision.two, requests, params)
    assert tp_vision.two.runner.num_images_encoded - encoded == 3  # once each, however many chunks cut it
    for r in requests:
        assert split[r].tokens == single[r].tokens, r
        assert split[r].logprobs == pytest.approx(single[r].logprobs, abs=ATOL), r
        got, want = ([p.chosen.logprob for p in res.prompt[1:]] for res in (split[r], single[r]))
        assert len(got) >= len(requests[r][0]) - 1 and got == pytest.approx(want, abs=ATOL), r


def test_a_prefix_hit_of_the_same_image_equals_the_cold_run(tp_vision):
    prompt = tp_vision.checkpoints.prompt_with(1, seed=4, lead=9)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    cold = _run(tp_vision.two, {"cold": (prompt, FILES[1:])}, params)["cold"]
    warm = _run(tp_vision.two, {"warm": (prompt, FILES[1:])}, params)["warm"]
    assert cold.cached == 0 and warm.cached >= 16  # into the image (from 10; Qwen3.5 resumes from a snapshot in it)
    assert warm.tokens == cold.tokens == _run(tp_vision.one, {"one": (prompt, FILES[1:])}, params)["one"].tokens
    assert warm.logprobs == pytest.approx(cold.logprobs, abs=ATOL)


def test_only_rank_0_reads_the_vision_tower(tp_vision):
    tower = ("visual.", "vision_tower.", "multi_modal_projector.")
    rank1, _ = load_model(str(tp_vision.path), torch.float32, torch.device("cpu"), tp=TensorParallel(1, 2))
    assert not [n for n, _ in rank1.named_parameters() if n.startswith(tower)]
    assert [n for n, _ in tp_vision.two.model.named_parameters() if n.startswith(tower)]
