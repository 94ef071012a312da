"""Encoder cross-encoders in the engine (Bert-, Roberta-, XLMRoberta- and ModernBertForSequenceClassification, tiny
random float32 configs): the head on the first token (ModernBERT's: or the tokens' mean, its classifier_pooling) gives
transformers' logits for the same text pairs, batched as alone, BERT reading the pair's token_type_ids; the activation
is the one config.json names, as vLLM reads it; a pair past the model's length is refused, never truncated; a
checkpoint the engine cannot score fails in one line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest
import torch

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.output.pooling import PoolingParams
from engine.errors import ContextTooLong, InvalidRequest, UnsupportedModel
from engine.outputs import PoolingOutput
from engine.sample.params import SamplingParams
from tests.cross_encoders import ENCODER_KINDS, build_encoder_cross_encoder, encode_pair, encoder_reference_logits
from tests.engine.core.engine_run import make_engine

ATOL = 1e-5
PAIRS = [
    ("what is a cat", "a cat is a small animal that purrs"),
    ("hello", "world of warcraft is a game"),
    ("how tall is the eiffel tower", "it is 330 metres tall"),
    ("one", " ".join(["two"] * 60)),
]


@pytest.fixture(scope="module", params=[*ENCODER_KINDS, "roberta", "modernbert"])
def scorer(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_encoder_cross_encoder(request.param, folder)
    return request.param, folder, hf


def engine_for(folder):
    # A step's budget of one longest prompt: an encoder runs a prompt whole, never in chunks.
    return make_engine(folder, max_num_batched_tokens=130, max_num_seqs=8)


def score_all(engine, requests: Mapping[str, tuple[list[int], list[int] | None]], activation: bool = True):
    for rid, (ids, types) in requests.items():
        params = PoolingParams(
            config=engine.spec.pooling,
            head=engine.spec.score_head,
            activation=activation,
            label_activation=engine.spec.classifier.activation,
            token_type_ids=types,
        )
        engine.add(rid, engine.prepare(ids, params))
    got: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert isinstance(out, PoolingOutput)
            got[out.request_id] = out.embedding
        assert not engine.pop_failures()
    assert engine.allocator.num_free == engine.allocator.num_pages, "a score kept pages"
    return got


def test_scores_equal_transformers_batched_and_alone(scorer) -> None:
    kind, folder, hf = scorer
    engine = engine_for(folder)
    assert engine.spec.architecture == type(hf).__name__ and engine.spec.classifier.source == "encoder"
    assert engine.spec.classifier.num_labels == 1
    pooling = "mean" if kind == "modernbert-mean" else "cls"
    assert engine.spec.pooling.method == pooling and engine.spec.pooling.whole_prompt
    pairs = {str(i): encode_pair(folder, a, b) for i, (a, b) in enumerate(PAIRS)}
    if kind in ("roberta", "xlm-roberta"):  # RoBERTa's pair template: </s></s> between the texts
        ids = pairs["1"][0]
        assert ids[ids.index(102) + 1] == 102
    batched = score_all(engine, pairs)
    raw = score_all(engine, pairs, activation=False)
    for rid, (ids, types) in pairs.items():
        logits = encoder_reference_logits(hf, kind, ids, types)
        torch.testing.assert_close(torch.tensor(raw[rid]), logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(batched[rid]), torch.sigmoid(logits), atol=ATOL, rtol=0)
        alone = score_all(engine, {rid: (ids, types)})[rid]
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(batched[rid]), atol=ATOL, rtol=0)
    assert len({round(v[0], 6) for v in batched.values()}) == len(PAIRS)  # the scores do depend on the pair


def test_bfloat16_on_the_cpu_scores_close_to_float32(scorer) -> None:
    """bf16 linears are packed for oneDNN on a CPU, the head's among them. ModernBERT's three pre-norm layers round
    more (transformers' own bf16 scores of these pairs are up to 0.013 from its float32 ones)."""
    kind, folder, _ = scorer
    pairs = {str(i): encode_pair(folder, a, b) for i, (a, b) in enumerate(PAIRS)}
    exact = score_all(engine_for(folder), pairs)
    rounded = score_all(make_engine(folder, max_num_batched_tokens=130, max_num_seqs=8, dtype="bfloat16"), pairs)
    atol = 0.03 if kind.startswith("modernbert") else 0.02
    for rid in pairs:
        torch.testing.assert_close(torch.tensor(rounded[rid]), torch.tensor(exact[rid]), atol=atol, rtol=0)


def test_bert_reads_the_pairs_token_type_ids(scorer) -> None:
    kind, folder, _ = scorer
    engine = engine_for(folder)
    ids, types = encode_pair(folder, *PAIRS[0])
    with_types = score_all(engine, {"t": (ids, types)})["t"]
    without = score_all(engine, {"z": (ids, [0] * len(ids))})["z"]
    if kind == "bert":
        assert set(types) == {0, 1} and with_types != without
    else:  # RoBERTa's, XLM-R's and ModernBERT's tokenizers give none, and their models read none
        assert with_types == without


def test_the_async_engine_scores_a_pair_and_refuses_to_generate_or_embed(scorer) -> None:
    kind, folder, hf = scorer
    ids, types = encode_pair(folder, *PAIRS[2])

    async_engine = AsyncEngine(EngineConfig(model_path=str(folder), dtype="float32", num_kv_pages=64))

    async def calls() -> PoolingOutput:
        scored = await async_engine.score(ids, "s", token_type_ids=types)
        with pytest.raises(InvalidRequest, match="cross-encoder"):
            await async_engine.generate(ids, SamplingParams(max_tokens=2), "g").__anext__()
        with pytest.raises(InvalidRequest, match="gives scores, not embeddings"):
            await async_engine.embed(ids, "e")
        return scored

    try:
        scored = asyncio.run(calls())
    finally:
        async_engine.shutdown()
    want = torch.sigmoid(encoder_reference_logits(hf, kind, ids, types))
    torch.testing.assert_close(torch.tensor(scored.embedding), want, atol=ATOL, rtol=0)


def test_a_pair_past_the_models_length_is_refused_and_not_truncated(scorer) -> None:
    _, folder, _ = scorer
    engine = engine_for(folder)
    ids, types = encode_pair(folder, "query", " ".join(["word"] * 200))
    params = PoolingParams(config=engine.spec.pooling, head=engine.spec.score_head, token_type_ids=types)
    with pytest.raises(ContextTooLong, match="maximum context length"):
        engine.prepare(ids, params)
    truncated = PoolingParams(config=engine.spec.pooling, head=engine.spec.score_head, truncate_prompt_tokens=64)
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
        engine.prepare(ids, truncated)
    with pytest.raises(InvalidRequest, match="token_type_ids"):
        engine.prepare(
            ids[:10], PoolingParams(config=engine.spec.pooling, head=engine.spec.score_head, token_type_ids=[0])
        )


@pytest.mark.parametrize(
    ("activation", "apply"),
    [
        ("torch.nn.modules.linear.Identity", lambda x: x),
        ("torch.nn.modules.activation.Sigmoid", torch.sigmoid),
        ("torch.nn.modules.activation.Tanh", torch.tanh),
    ],
)
def test_the_activation_config_json_names_is_applied(tmp_path, activation, apply) -> None:
    hf = build_encoder_cross_encoder("bert", tmp_path)
    _rewrite(tmp_path, sentence_transformers={"activation_fn": activation, "version": "4.0.1"})
    engine = engine_for(tmp_path)
    ids, types = encode_pair(tmp_path, *PAIRS[0])
    got = score_all(engine, {"a": (ids, types)})["a"]
    torch.testing.assert_close(
        torch.tensor(got), apply(encoder_reference_logits(hf, "bert", ids, types)), atol=ATOL, rtol=0
    )


def test_a_roberta_pooler_in_the_folder_is_not_read_as_the_head(tmp_path) -> None:
    """Some XLM-R reranker folders also hold `roberta.pooler.*`, which their classification head never reads."""
    from safetensors.torch import load_file, save_file

    hf = build_encoder_cross_encoder("xlm-roberta", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    prefix = next(name for name in weights if name.endswith("embeddings.word_embeddings.weight")).split(".")[0]
    hidden = weights["classifier.dense.weight"].shape[0]
    weights[f"{prefix}.pooler.dense.weight"] = torch.randn(hidden, hidden)
    weights[f"{prefix}.pooler.dense.bias"] = torch.randn(hidden)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids, types = encode_pair(tmp_path, *PAIRS[0])
    got = score_all(engine_for(tmp_path), {"a": (ids, types)})["a"]
    want = torch.sigmoid(encoder_reference_logits(hf, "xlm-roberta", ids, types))
    torch.testing.assert_close(torch.tensor(got), want, atol=ATOL, rtol=0)


def test_several_labels_are_softmaxed_as_vllm_does(tmp_path) -> None:
    hf = build_encoder_cross_encoder("xlm-roberta", tmp_path, num_labels=3)
    engine = engine_for(tmp_path)
    assert engine.spec.classifier.num_labels == 3
    ids, types = encode_pair(tmp_path, *PAIRS[1])
    got = score_all(engine, {"a": (ids, types)})["a"]
    want = torch.softmax(encoder_reference_logits(hf, "xlm-roberta", ids, types), dim=-1)
    torch.testing.assert_close(torch.tensor(got), want, atol=ATOL, rtol=0)


def _rewrite(folder, **keys) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(keys)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"architectures": ["DistilBertForSequenceClassification"]}, "bidirectional encoder (BERT-like)"),
        ({"architectures": ["ElectraForSequenceClassification"]}, "bidirectional encoder (BERT-like)"),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.GELU"}, "activation"),
        ({"id2label": {"0": "a", "1": "b"}}, "config.json gives 2 labels, classifier.weight has 1"),
    ],
)
def test_checkpoints_the_engine_cannot_score_fail_in_one_line(tmp_path, keys, words) -> None:
    from engine.model.folder_check import check_model_folder

    build_encoder_cross_encoder("bert", tmp_path)
    _rewrite(tmp_path, **keys)
    with pytest.raises(UnsupportedModel) as err:
        check_model_folder(tmp_path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_modernbert_pooling_its_first_token_or_the_mean_scores_apart(tmp_path) -> None:
    """The same weights scored by the first token and by the mean give transformers' two scores, which differ."""
    got, want = {}, {}
    for kind in ("modernbert", "modernbert-mean"):
        hf = build_encoder_cross_encoder(kind, tmp_path / kind)
        ids, types = encode_pair(tmp_path / kind, *PAIRS[3])  # 60 words: past the local window of 8 either side
        assert len(ids) > 16
        got[kind] = score_all(engine_for(tmp_path / kind), {"a": (ids, types)}, activation=False)["a"]
        want[kind] = encoder_reference_logits(hf, kind, ids, types)
        torch.testing.assert_close(torch.tensor(got[kind]), want[kind], atol=ATOL, rtol=0)
    assert abs(got["modernbert"][0] - got["modernbert-mean"][0]) > 1e-3


def test_modernbert_head_with_biases_a_tanh_gelu_and_weights_without_the_model_prefix(tmp_path) -> None:
    """classifier_bias, norm_bias and classifier_activation as config.json sets them; a folder whose encoder tensors
    lack `model.` (as some exports save them) loads the same."""
    from safetensors.torch import load_file, save_file

    keys = dict(classifier_bias=True, norm_bias=True, classifier_activation="gelu_pytorch_tanh", num_labels=3)
    hf = build_encoder_cross_encoder("modernbert-mean", tmp_path, **keys)
    weights = load_file(tmp_path / "model.safetensors")
    assert "head.dense.bias" in weights and "head.norm.bias" in weights
    save_file(
        {name.removeprefix("model."): w for name, w in weights.items()},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    engine = engine_for(tmp_path)
    assert engine.spec.classifier.num_labels == 3
    for a, b in PAIRS:
        ids, types = encode_pair(tmp_path, a, b)
        got = score_all(engine, {"a": (ids, types)})["a"]
        want = torch.softmax(encoder_reference_logits(hf, "modernbert-mean", ids, types), dim=-1)
        torch.testing.assert_close(torch.tensor(got), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"classifier_pooling": "max"}, "classifier_pooling 'max' is not supported"),
        ({"classifier_activation": "relu"}, "classifier_activation 'relu' is not supported"),
    ],
)
def test_modernbert_heads_the_engine_cannot_run_fail_in_one_line(tmp_path, keys, words) -> None:
    from engine.model.folder_check import check_model_folder

    build_encoder_cross_encoder("modernbert", tmp_path)
    _rewrite(tmp_path, **keys)
    with pytest.raises(UnsupportedModel) as err:
        check_model_folder(tmp_path)
    assert words in str(err.value) and "\n" not in str(err.value)
