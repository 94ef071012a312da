"""TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes) for the hybrid families, Qwen3.5 dense and MoE, Qwen3-Next
(fused DeltaNet projections), Nemotron-H (Mamba2 groups, relu^2 MLP and experts), Falcon-H1 (attention and Mamba2
side by side in every layer) and Granite 4.0-H (Mamba2 groups, experts beside the shared MLP or that MLP alone,
rotary-free attention), on tiny random float32 checkpoints: each rank holds its Gated DeltaNet heads or Mamba2 groups
and their states in its own state pool, under the slot ids of rank 0's scheduler. Against one rank and transformers:
the prompt's log-probabilities over chunked prefill (a 16-token step budget, prompts longer than one DeltaNet or
Mamba2 chunk), greedy answers batched and alone, a prefix-cache hit from a state snapshot, forked choices; a size that
does not divide the DeltaNet heads is refused in one line, one past the Mamba2 groups splits a group's heads; no rank
is left behind."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import StartupError
from engine.sample.params import SamplingParams
from tests.engine.core.distributed.tp_models import child_pids, copy_tokenizer
from tests.engine.core.engine_run import run
from tests.engine.model.family_parity import hf_greedy, mixed_prompts, reference_logits, tiny_engine
from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint
from tests.engine.model.mamba_checkpoints import (
    build_falcon_h1_checkpoint,
    build_granite_hybrid_checkpoint,
    build_nemotron_h_checkpoint,
)

ATOL = 2e-4  # log-probabilities, float32: the ranks sum the same products in another order
VOCAB = 128


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "qwen3_next",
        "nemotron_h",
        "falcon_h1",
        "falcon_h1_one_group",
        "granitemoehybrid",
        "granitemoehybrid_dense",
        "granitemoehybrid_one_group",
    ],
)
def tp_hybrid(request, tmp_path_factory, baked_model_path):
    """(transformers model, TP=1 engine, TP=2 engine, path) over one checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "nemotron_h":
        hf = build_nemotron_h_checkpoint(path)
    elif request.param.startswith("falcon_h1"):  # _one_group: each rank half the group, its norm before the gate
        hf = build_falcon_h1_checkpoint(path, **({"mamba_n_groups": 1} if request.param.endswith("_one_group") else {}))
    elif request.param.startswith("granitemoehybrid"):  # _dense: no experts; _one_group: one Mamba2 group, as released
        change = {"_dense": {"num_local_experts": 0}, "_one_group": {"mamba_n_groups": 1}}
        hf = build_granite_hybrid_checkpoint(path, **change.get(request.param.removeprefix("granitemoehybrid"), {}))
    else:
        hf = build_hybrid_checkpoint(request.param, path)
    copy_tokenizer(path, baked_model_path)
    before = child_pids()
    one = tiny_engine(path)
    two = tiny_engine(path, tensor_parallel_size=2)
    assert len(child_pids() - before) == 1  # rank 1
    yield hf, one, two, path
    two.close()
    one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_each_rank_holds_half_the_deltanet_heads(tp_hybrid):
    _, one, two, path = tp_hybrid
    assert two.spec.recurrent.state_shape[0] * 2 == one.spec.recurrent.state_shape[0]
    if "one_group" in path.name:  # half the heads' x channels, the one group's B and C on both ranks
        heads, head_dim, _ = one.spec.recurrent.state_shape
        assert one.spec.recurrent.conv_shape[0] - two.spec.recurrent.conv_shape[0] == heads * head_dim // 2
    else:
        assert two.spec.recurrent.conv_shape[0] * 2 == one.spec.recurrent.conv_shape[0]
    assert two.state_pool.num_slots == one.state_pool.num_slots


def test_prompt_logprobs_over_chunks_match_one_rank_and_transformers(tp_hybrid):
    hf, one, two, _ = tp_hybrid
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 23, 70)]
    requests = {f"r{i}": (p, greedy(1, prompt_logprobs=0)) for i, p in enumerate(prompts)}
    single, split = run(one, requests), run(two, requests)
    for i, prompt in enumerate(prompts):
        ref = torch.log_softmax(reference_logits(hf, prompt), dim=-1)
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
        got = [p.chosen.logprob for p in split[f"r{i}"].first.prompt_logprobs[1:]]
        assert got == pytest.approx(expected, abs=ATOL)
        assert got == pytest.approx([p.chosen.logprob for p in single[f"r{i}"].first.prompt_logprobs[1:]], abs=ATOL)


def test_greedy_equals_transformers_batched_alone_and_from_the_prefix_cache(tp_hybrid):
    hf, one, two, _ = tp_hybrid
    requests = {r: (p, greedy(10)) for r, p in mixed_prompts().items()}
    batched = {r: res.choices[0].token_ids for r, res in run(two, requests).items()}
    again = {r: res.choices[0].token_ids for r, res in run(two, requests).items()}  # prefix hits
    single = {r: res.choices[0].token_ids for r, res in run(one, requests).items()}
    assert batched == again == single
    for r, (prompt, params) in requests.items():
        assert batched[r] == hf_greedy(hf, prompt, 10), r
        assert run(two, {r: (prompt, params)})[r].choices[0].token_ids == batched[r], r


def test_a_prefix_hit_starts_every_rank_from_its_snapshot(tp_hybrid):
    """A second turn repeating the first turn and its answer hits the cache past the first prompt (a decode-time
    state snapshot, taken on every rank) and gives a cold run's tokens."""
    hf, one, two, _ = tp_hybrid
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(3, VOCAB, (21,), generator=gen).tolist()
    answer = run(two, {"t1": (first, greedy(6))})["t1"].choices[0].token_ids
    second = first + answer + torch.randint(3, VOCAB, (9,), generator=gen).tolist()
    warm = run(two, {"t2": (second, greedy(6))})["t2"]
    assert warm.last.num_cached_tokens >= 24
    assert warm.choices[0].token_ids == hf_greedy(hf, second, 6)


def test_forked_choices_match_one_rank(tp_hybrid):
    """n=2 sampled choices fork from one prefilled prompt: each rank copies its heads' state to the fork."""
    _, one, two, _ = tp_hybrid
    prompt = torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=0, ignore_eos=True)
    a, b = run(one, {"f": (prompt, params)})["f"], run(two, {"f": (prompt, params)})["f"]
    assert [c.token_ids for c in a.choices.values()] == [c.token_ids for c in b.choices.values()]


def test_a_size_that_cuts_the_recurrent_heads_is_refused(tp_hybrid):
    from engine.core.distributed.ranks import rank_config
    from engine.model.loader import shard_refusal

    path = tp_hybrid[3]
    if tp_hybrid[1].spec.recurrent.kind == "mamba2":  # more ranks than groups split a group's heads
        assert shard_refusal(str(path), 4) is None
        return
    what = "2 linear-attention key heads"
    with pytest.raises(StartupError, match=f"tensor_parallel_size=4 does not divide the model's {what}"):
        rank_config(EngineConfig(model_path=str(path), tensor_parallel_size=4), torch.device("cpu"))
