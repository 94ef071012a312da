"""Cross-encoders in LLMEngine: the score head on the last token's final hidden state gives transformers' scores
(float32, tiny random Qwen3 / Llama `*ForSequenceClassification` and Qwen3-Reranker's yes/no layout), alone, chunked,
batched and beside generation; such a model refuses to generate, and a checkpoint the engine cannot score fails
its check in one line."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.output.pooling import PoolingParams
from engine.errors import InvalidRequest, UnsupportedModel
from engine.model.loader import check_checkpoint
from engine.outputs import PoolingOutput
from engine.sample.params import SamplingParams
from tests.cross_encoders import KINDS, build_cross_encoder, reference_scores
from tests.engine.core.engine_run import make_engine, random_prompts

ATOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def encoder(request, tmp_path_factory, baked_model_path):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_cross_encoder(request.param, folder, baked_model_path)
    # A 16-token step budget: the longer prompts run in chunks.
    return request.param, hf, make_engine(folder, page_size=4, max_num_batched_tokens=16, max_num_seqs=8)


def score_all(engine, prompts: dict[str, list[int]], activation: bool = True) -> dict[str, list[float]]:
    for rid, prompt in prompts.items():
        params = PoolingParams(config=engine.spec.pooling, head=engine.spec.score_head, activation=activation)
        engine.add(rid, engine.prepare(prompt, params))
    got: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert isinstance(out, PoolingOutput)
            got[out.request_id] = out.embedding
        assert not engine.pop_failures()
    assert engine.allocator.num_free == engine.allocator.num_pages, "a score kept pages"
    return got


def test_scores_match_transformers_alone_chunked_and_batched(encoder) -> None:
    kind, hf, engine = encoder
    assert engine.spec.classifier.num_labels == (3 if kind == "llama3" else 1)
    prompts = {str(n): random_prompts(1, n, n, seed=n)[0] for n in (1, 5, 16, 37)}
    batched = score_all(engine, prompts)
    for n, prompt in prompts.items():
        want = reference_scores(hf, kind, prompt)
        torch.testing.assert_close(torch.tensor(batched[n]), torch.tensor(want), atol=ATOL, rtol=0)
        torch.testing.assert_close(
            torch.tensor(score_all(engine, {n: prompt})[n]), torch.tensor(want), atol=ATOL, rtol=0
        )
    assert len({round(v[0], 6) for v in batched.values()}) == len(prompts)  # the scores do depend on the prompt


def test_raw_logits_without_the_activation(encoder) -> None:
    kind, hf, engine = encoder
    prompt = random_prompts(1, 9, 9, seed=3)[0]
    [raw] = score_all(engine, {"r": prompt}, activation=False).values()
    activated = torch.sigmoid(torch.tensor(raw)) if len(raw) == 1 else torch.softmax(torch.tensor(raw), dim=-1)
    torch.testing.assert_close(activated, torch.tensor(reference_scores(hf, kind, prompt)), atol=ATOL, rtol=0)


def test_a_shared_prefix_is_served_from_the_prefix_cache(encoder) -> None:
    kind, hf, engine = encoder
    query = random_prompts(1, 24, 24, seed=11)[0]
    docs = random_prompts(3, 3, 9, seed=12)
    score_all(engine, {"a": query + docs[0]})
    engine.add(
        "b", engine.prepare(query + docs[1], PoolingParams(config=engine.spec.pooling, head=engine.spec.score_head))
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens >= 20  # the query's whole pages
    torch.testing.assert_close(
        torch.tensor(outs[0].embedding), torch.tensor(reference_scores(hf, kind, query + docs[1])), atol=ATOL, rtol=0
    )


def test_a_cross_encoder_scores_through_the_async_engine_and_does_not_generate(encoder) -> None:
    kind, hf, engine = encoder
    async_engine = AsyncEngine(EngineConfig(model_path=engine.config.model_path, dtype="float32", num_kv_pages=64))
    prompt = random_prompts(1, 7, 7, seed=5)[0]

    async def calls():
        scored = await async_engine.score(prompt, "s")
        with pytest.raises(InvalidRequest, match="cross-encoder"):
            await async_engine.generate(prompt, SamplingParams(max_tokens=2), "g").__anext__()
        with pytest.raises(InvalidRequest, match="gives scores, not embeddings"):
            await async_engine.embed(prompt, "e")
        return scored

    try:
        scored = asyncio.run(calls())
    finally:
        async_engine.shutdown()
    torch.testing.assert_close(
        torch.tensor(scored.embedding), torch.tensor(reference_scores(hf, kind, prompt)), atol=ATOL, rtol=0
    )


def _rewrite(folder, **keys) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(keys)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("kind", "keys", "words"),
    [
        (
            "llama",
            {"num_labels": 2, "id2label": {"0": "a", "1": "b"}},
            "config.json gives 2 labels, score.weight has 1",
        ),
        ("reranker", {"classifier_from_token": ["no"]}, "classifier_from_token is supported as Qwen3-Reranker's"),
        ("reranker", {"classifier_from_token": ["no", "not-a-single-token"]}, "is not one token of the vocabulary"),
        (
            "reranker",
            {"architectures": ["Qwen3ForCausalLM"], "is_original_qwen3_reranker": False, "classifier_from_token": None},
            None,
        ),
        (
            "llama",
            {"architectures": ["MistralForSequenceClassification"]},
            "MistralForSequenceClassification is not supported",
        ),
        ("llama", {"architectures": ["DistilBertForSequenceClassification"]}, "bidirectional encoder (BERT-like)"),
    ],
)
def test_checkpoints_the_engine_cannot_score_fail_in_one_line(tmp_path, baked_model_path, kind, keys, words) -> None:
    from engine.model.folder_check import check_model_folder

    build_cross_encoder(kind, tmp_path, baked_model_path)
    _rewrite(tmp_path, **keys)
    if words is None:  # vLLM's overrides taken away: a plain causal LM again, which checks fine
        assert check_checkpoint(str(tmp_path)) == "Qwen3ForCausalLM"
        return
    with pytest.raises(UnsupportedModel) as err:
        check_model_folder(tmp_path)
    assert words in str(err.value) and "\n" not in str(err.value)
