"""Multi-head latent attention (DeepSeek-V2 without q_lora_rank, DeepSeek-V3 with it, a V3 with attention biases and
rotary halves, GLM-4.7-Flash) at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): each rank runs half the
heads over a full, identical copy of the latent pages, and the MoE and dense MLPs split as GLM-4.5's. Against one rank
and transformers in float32: a prompt over several pages (log-probabilities within a tight tolerance), mixed prompts
batched (chunked prefill, a shared prefix) greedy equal, and a batch of two whose tokens and top log-probabilities
equal one rank's; a KV byte budget buys each rank as many pages as one rank gets (a rank's pages hold whole latents)."""

from __future__ import annotations

import pytest
import torch

from engine.sample.params import SamplingParams
from tests.engine.conftest import TINY
from tests.engine.core.distributed.tp_models import check_split_answers, child_pids, copy_tokenizer
from tests.engine.core.engine_run import make_engine, run
from tests.engine.model.family_parity import reference_logits
from tests.engine.model.mla_checkpoints import MLA, build_mla_checkpoint

KINDS = ("deepseek_v2_lite", "deepseek_v3", "deepseek_v3_halves", "glm4_moe_lite")
ATOL = 2e-4  # log-probabilities, float32: the ranks sum the same products in another order
PAGE_SIZE = 4
PAGES = 96
LATENT_WIDTH = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
# Three layers of one latent row per token, float32: the bytes of PAGES pages on a rank that holds whole latents.
KV_BYTES = PAGES * PAGE_SIZE * MLA["num_hidden_layers"] * LATENT_WIDTH * 4


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Random prompts of these lengths over the checkpoints' vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=KINDS)
def mla_pair(request, tmp_path_factory, baked_model_path):
    """(kind, transformers model, TP=1 engine, TP=2 engine) over one checkpoint, pages of 4 tokens, 16-token steps."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build_mla_checkpoint(request.param, path)
    copy_tokenizer(path, baked_model_path)
    kw = dict(page_size=PAGE_SIZE, num_kv_pages=None, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=16)
    before = child_pids()
    one = make_engine(path, **kw)
    two = make_engine(path, tensor_parallel_size=2, **kw)
    assert len(child_pids() - before) == 1  # rank 1
    yield request.param, hf, one, two
    two.close()
    one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def test_each_rank_runs_half_the_heads_over_whole_latent_pages(mla_pair):
    kind, _, one, two = mla_pair
    assert (one.spec.num_q_heads, two.spec.num_q_heads) == (MLA["num_attention_heads"], MLA["num_attention_heads"] // 2)
    assert two.model.model.layers[0].self_attn.shape.num_heads == MLA["num_attention_heads"] // 2
    (group,) = two.spec.kv_groups
    assert group.latent is not None and group.values_per_token == LATENT_WIDTH
    ckv, kpe = two.pools[0].kv_caches[0]
    assert (ckv.shape[-1], kpe.shape[-1]) == (MLA["kv_lora_rank"], MLA["qk_rope_head_dim"])
    assert two.kv.allocators[0].num_pages == one.kv.allocators[0].num_pages == PAGES, kind


def test_split_answers_equal_one_rank_and_transformers(mla_pair):
    """A 22-token prompt (six pages, two prefill chunks): its log-probabilities; mixed prompts, batched: greedy."""
    kind, hf, one, two = mla_pair
    (prompt,) = prompts((22,), seed=4)
    check_split_answers(lambda tokens: reference_logits(hf, tokens), one, two, prompt, 6, atol=ATOL)


def test_a_batch_of_two_answers_as_one_rank(mla_pair):
    kind, _, one, two = mla_pair
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    requests = {f"b{i}": (p, params) for i, p in enumerate(prompts((9, 27), seed=5))}
    split, single = run(two, requests), run(one, requests)
    for r in requests:
        a, b = split[r].choices[0], single[r].choices[0]
        assert a.token_ids == b.token_ids, (kind, r)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top], (kind, r)
            assert [t.logprob for t in x.top] == pytest.approx([t.logprob for t in y.top], abs=ATOL), (kind, r)
