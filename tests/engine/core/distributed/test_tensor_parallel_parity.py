"""TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes) against one rank and against transformers, on tiny random
float32 checkpoints of each family that shards: the prompt's log-probabilities within a tight tolerance, greedy
answers equal, a batch equal to its requests run alone, and no rank left behind."""

from __future__ import annotations

import pytest
import torch

from tests.engine.core.distributed.tp_models import KINDS, KV_GROUPS, child_pids, save_tp_model
from tests.engine.core.engine_run import greedy, make_engine, random_prompts, run

ATOL = 2e-4  # log-probabilities, float32: the ranks sum the same products in another order


@pytest.fixture(scope="module", params=KINDS)
def tp_pair(request, tmp_path_factory, baked_model_path):
    """(kind, transformers model, TP=1 engine, TP=2 engine) over one checkpoint."""
    import transformers as tf

    path = save_tp_model(request.param, tmp_path_factory.mktemp(request.param), baked_model_path)
    before = child_pids()
    one = make_engine(path)
    two = make_engine(path, tensor_parallel_size=2)
    assert len(child_pids() - before) == 1  # rank 1
    # eager: Gemma's soft-capped attention is transformers' eager path
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    yield request.param, hf, one, two
    two.close()
    one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def prompt_logprobs(result) -> list[float]:
    return [p.chosen.logprob for p in result.first.prompt_logprobs[1:]]


def test_prompt_logprobs_match_one_rank_and_transformers(tp_pair):
    kind, hf, one, two = tp_pair
    assert len(two.pools) == KV_GROUPS.get(kind, 1)  # KV layer groups, each rank's pools alike
    prompts = random_prompts(3, 5, 40, seed=1)
    requests = {f"r{i}": (p, greedy(1, prompt_logprobs=0)) for i, p in enumerate(prompts)}
    single, split = run(one, requests), run(two, requests)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
        got = prompt_logprobs(split[f"r{i}"])
        assert got == pytest.approx(expected, abs=ATOL), kind
        assert got == pytest.approx(prompt_logprobs(single[f"r{i}"]), abs=ATOL), kind


def test_greedy_answers_equal_transformers_batched_and_alone(tp_pair):
    kind, hf, one, two = tp_pair
    prompts = random_prompts(4, 3, 30, seed=2)
    requests = {f"r{i}": (p, greedy(12, logprobs=3)) for i, p in enumerate(prompts)}
    batched = run(two, requests)
    single = run(one, requests)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        alone = run(two, {rid: requests[rid]})[rid].choices[0]
        answer = batched[rid].choices[0]
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert answer.token_ids == ref, kind
        assert answer.token_ids == alone.token_ids == single[rid].choices[0].token_ids, kind
        for a, b in zip(answer.logprobs, single[rid].choices[0].logprobs, strict=True):
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
            assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=ATOL)


def test_sampled_answers_and_n_match_one_rank(tp_pair):
    """Sampling happens on rank 0 from the gathered logits: the same seed draws the same tokens as one rank."""
    _, _, one, two = tp_pair
    from engine.sample.params import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, n=2, seed=7)
    requests = {"s": (random_prompts(1, 8, 8, seed=3)[0], params)}
    a, b = run(one, requests)["s"], run(two, requests)["s"]
    assert [c.token_ids for c in a.choices.values()] == [c.token_ids for c in b.choices.values()]
