"""Embedding requests in LLMEngine: the pooled final hidden states equal transformers' pooled the same way (mean,
CLS and last token; normalised or not; shortened), whether run alone, in a batch, chunked, or in the same steps as
generation; they give their pages back, share the prefix cache, and refuse what the model cannot do."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.core.engine import LLMEngine
from engine.core.output.pooling import PoolingParams
from engine.errors import ContextTooLong, InvalidRequest
from engine.outputs import PoolingOutput, RequestOutput
from tests.engine.core.engine_run import greedy, make_engine, random_prompts, run

ATOL = 1e-5


def with_pooling(src, dst, mode: str | None, normalize: bool = True, **config_keys) -> str:
    """A copy of the tiny model with sentence-transformers files for `mode` (None: none shipped)."""
    shutil.copytree(src, dst)
    if mode is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            )
        (dst / "modules.json").write_text(json.dumps(modules))
        (dst / "1_Pooling").mkdir()
        flags = {f"pooling_mode_{m}": m == mode for m in ("mean_tokens", "cls_token", "lasttoken", "max_tokens")}
        (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    if config_keys:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **config_keys}))
    return str(dst)


def close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=ATOL, rtol=0)


def reference(hf, prompt: list[int], method: str, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].float()
    vector = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[method]
    vector = vector[:dimensions] if dimensions else vector
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def embed_all(engine: LLMEngine, prompts: dict[str, list[int]], **kw) -> dict[str, PoolingOutput]:
    for rid, prompt in prompts.items():
        engine.add(rid, engine.prepare(prompt, PoolingParams(config=engine.spec.pooling, **kw)))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = out
        assert not engine.pop_failures()
    assert engine.allocator.num_free == engine.allocator.num_pages, "an embedding kept pages"
    return got


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


@pytest.mark.parametrize(
    ("mode", "method", "normalize"),
    [("mean_tokens", "mean", True), ("cls_token", "cls", False), ("lasttoken", "last", True), (None, "last", True)],
)
def test_pooled_hidden_states_match_transformers(tiny_model_path, tmp_path, hf, mode, method, normalize):
    path = with_pooling(tiny_model_path, tmp_path / "m", mode, normalize)
    # A 16-token step budget: the longer prompts run in chunks, which the pooling folds together.
    engine = make_engine(path, page_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    assert (engine.spec.pooling.method, engine.spec.pooling.normalize) == (method, normalize)
    prompts = {str(n): random_prompts(1, n, n, seed=n)[0] for n in (1, 5, 16, 37)}
    got = embed_all(engine, prompts)
    for n, prompt in prompts.items():
        assert got[n].num_prompt_tokens == len(prompt)
        torch.testing.assert_close(
            torch.tensor(got[n].embedding), reference(hf, prompt, method, normalize), atol=ATOL, rtol=0
        )
    # A batch equals each alone (to float32 rounding: the batch splits the prompts into other chunks).
    for n, prompt in prompts.items():
        close(got[n].embedding, embed_all(engine, {n: prompt})[n].embedding)


def test_embeddings_in_the_same_steps_as_generation_change_nothing(tiny_model_path, tmp_path):
    engine = make_engine(with_pooling(tiny_model_path, tmp_path / "m", "mean_tokens"), page_size=4)
    chats = {f"g{i}": (p, greedy(6, ignore_eos=True)) for i, p in enumerate(random_prompts(3, 5, 30, seed=7))}
    texts = {f"e{i}": p for i, p in enumerate(random_prompts(4, 3, 40, seed=8))}
    solo_gen = {r: run(engine, {r: req})[r].choices[0].token_ids for r, req in chats.items()}
    solo_emb = {r: embed_all(engine, {r: p})[r].embedding for r, p in texts.items()}
    for r, (prompt, params) in chats.items():
        engine.add_request(r, prompt, params)
    engine.step()  # the generations' prompts run; now they decode
    for r, prompt in texts.items():
        engine.add(r, engine.prepare(prompt, PoolingParams(config=engine.spec.pooling)))
    tokens: dict[str, list[int]] = {r: [] for r in chats}
    embeddings, mixed_steps = {}, 0
    while engine.has_unfinished():
        outputs = engine.step()
        kinds = {type(o) for o in outputs}
        mixed_steps += kinds == {PoolingOutput, RequestOutput}
        for out in outputs:
            if isinstance(out, PoolingOutput):
                embeddings[out.request_id] = out.embedding
            else:
                tokens[out.request_id] += out.outputs[0].token_ids
    assert mixed_steps >= 1, "no step ran embeddings and generation together"
    assert tokens == {r: t[1:] for r, t in solo_gen.items()}  # the first tokens came from the first step
    assert embeddings.keys() == solo_emb.keys()
    for r, vector in embeddings.items():
        close(vector, solo_emb[r])
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_last_token_pooling_shares_the_prefix_cache_and_mean_pooling_runs_every_row(tiny_model_path, tmp_path):
    prompt = random_prompts(1, 40, 40, seed=4)[0]
    for mode, cached in (("lasttoken", 36), ("mean_tokens", 0)):
        engine = make_engine(with_pooling(tiny_model_path, tmp_path / mode, mode), page_size=4)
        run(engine, {"chat": (prompt, greedy(2, ignore_eos=True))})  # its full pages stay in the prefix cache
        hit = embed_all(engine, {"a": prompt})["a"]
        assert hit.num_cached_tokens == cached
        cold = embed_all(
            make_engine(engine.config.model_path, page_size=4, enable_prefix_caching=False), {"a": prompt}
        )["a"]
        close(hit.embedding, cold.embedding)


def test_dimensions_shorten_only_a_matryoshka_model(tiny_model_path, tmp_path, hf):
    plain = make_engine(with_pooling(tiny_model_path, tmp_path / "plain", None), page_size=4)
    with pytest.raises(InvalidRequest) as err:
        plain.prepare([5, 6, 7], PoolingParams(config=plain.spec.pooling, dimensions=16))
    assert err.value.param == "dimensions"
    listed = make_engine(
        with_pooling(tiny_model_path, tmp_path / "mrl", None, matryoshka_dimensions=[16, 32, 64]), page_size=4
    )
    prompt = random_prompts(1, 9, 9, seed=5)[0]
    got = embed_all(listed, {"a": prompt}, dimensions=16)["a"].embedding
    assert len(got) == 16
    torch.testing.assert_close(torch.tensor(got), reference(hf, prompt, "last", True, 16), atol=ATOL, rtol=0)
    for bad in (8, 65):
        with pytest.raises(InvalidRequest, match="dimensions"):
            listed.prepare(prompt, PoolingParams(config=listed.spec.pooling, dimensions=bad))


def test_an_input_longer_than_the_context_fails_unless_truncated(tiny_model_path, tmp_path, hf):
    engine = make_engine(with_pooling(tiny_model_path, tmp_path / "m", None), page_size=4, max_model_len=32)
    prompt = random_prompts(1, 33, 33, seed=6)[0]
    with pytest.raises(ContextTooLong):
        engine.prepare(prompt, PoolingParams(config=engine.spec.pooling))
    full = embed_all(engine, {"a": prompt[1:]})["a"]  # exactly the context: nothing has to follow an embedding
    cut = embed_all(engine, {"b": prompt}, truncate_prompt_tokens=32)["b"]
    assert cut.prompt_token_ids == prompt[1:]
    close(cut.embedding, full.embedding)
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
        engine.prepare(prompt, PoolingParams(config=engine.spec.pooling, truncate_prompt_tokens=33))
