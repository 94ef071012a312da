"""Speculative decoding with a draft model: greedy output token for token as without it, with the baked SmolLM2 as
its own draft (nearly every proposal accepted) and a tiny random model on the same tokenizer (most refused), batched
with requests that cannot speculate; its own KV pool given back; a draft with another tokenizer refused at start."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.config import SpeculativeConfig
from engine.errors import StartupError
from engine.sample.params import SamplingParams
from tests.engine.conftest import ENGINE_TINY, _save_tiny_engine_model
from tests.engine.core.engine_run import greedy, make_engine, run


def _draft(path, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="draft_model", model=str(path), num_speculative_tokens=3, **{"disable_by_batch_size": 256, **kw}
    )


@pytest.fixture(scope="module")
def plain(baked_model_path):
    return make_engine(baked_model_path, num_kv_pages=256)


@pytest.fixture(scope="module")
def tiny_draft_path(tmp_path_factory, baked_model_path):
    """A 2-layer random Llama with SmolLM2's whole vocabulary and tokenizer: a draft that is mostly wrong."""
    import transformers as tf

    config = tf.LlamaConfig(**{**ENGINE_TINY, "vocab_size": 49152}, num_hidden_layers=2)
    return _save_tiny_engine_model(config, tmp_path_factory.mktemp("tiny-draft"), baked_model_path)


@pytest.fixture(scope="module")
def requests(plain):
    tok = plain.tokenizer
    return {
        "story": (tok.encode("Once upon a time"), greedy(20)),
        "code": (tok.encode("def fibonacci(n):"), greedy(16, logprobs=2)),
        "stop": (tok.encode("The capital of France is"), greedy(16, stop=["."])),
        "beam": (tok.encode("The sea"), SamplingParams(temperature=0.0, max_tokens=8, n=2, use_beam_search=True)),
    }


def _tokens(results) -> dict[str, list[list[int]]]:
    return {r: [c.token_ids for _, c in sorted(res.choices.items())] for r, res in results.items()}


def test_the_model_as_its_own_draft_is_exact_and_accepts_nearly_everything(baked_model_path, plain, requests):
    spec = make_engine(baked_model_path, num_kv_pages=256, speculative=_draft(baked_model_path))
    a, b = run(plain, requests, join_at={"beam": 2}), run(spec, requests, join_at={"beam": 2})
    assert _tokens(a) == _tokens(b)
    assert [c.text for c in b["stop"].choices.values()] == [c.text for c in a["stop"].choices.values()]
    got, want = b["code"].choices[0].logprobs, a["code"].choices[0].logprobs
    assert [p.chosen.logprob for p in got] == pytest.approx([p.chosen.logprob for p in want], abs=1e-4)
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] > 0.9 and stats["spec_mean_accepted_length"] > 3
    draft = spec.speculator.proposer
    assert draft.kv.num_free == [a.num_pages for a in draft.kv.allocators]  # every draft page given back
    draft.kv.check()


def test_a_tiny_random_draft_on_the_same_tokenizer_is_exact(baked_model_path, tiny_draft_path, plain, requests):
    spec = make_engine(baked_model_path, num_kv_pages=256, speculative=_draft(tiny_draft_path, draft_kv_pages=64))
    picked = {r: requests[r] for r in ("story", "stop")}
    # A small target pool: the draft's shadows follow preemption too.
    tight = make_engine(
        baked_model_path, num_kv_pages=6, max_model_len=64, page_size=16, speculative=_draft(baked_model_path)
    )
    crowd = {f"c{i}": (requests["story"][0] + [11] * i, greedy(24, ignore_eos=True)) for i in range(4)}
    assert _tokens(run(spec, picked)) == _tokens(run(plain, picked))
    assert spec.stats()["spec_verify_steps"] > 0
    assert _tokens(run(tight, crowd)) == _tokens(run(plain, crowd))
    assert tight.scheduler.num_preemptions > 0 and tight.stats()["spec_accepted_tokens"] > 0


def test_a_draft_with_another_tokenizer_or_vocabulary_fails_the_start_in_one_line(
    baked_model_path, tiny_model_path, tiny_draft_path, tmp_path
):
    with pytest.raises(StartupError) as info:  # SmolLM2's tokenizer, but 1024 embeddings
        make_engine(baked_model_path, num_kv_pages=64, speculative=_draft(tiny_model_path))
    assert "vocabulary of 1024 tokens" in str(info.value) and "\n" not in str(info.value)
    other = tmp_path / "other"
    shutil.copytree(tiny_draft_path, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first = next(iter(vocab))
    vocab["renamed-token"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(StartupError) as info:
        make_engine(baked_model_path, num_kv_pages=64, speculative=_draft(other))
    assert "another tokenizer" in str(info.value) and "\n" not in str(info.value)


def test_a_draft_with_sliding_windows_runs_ahead_and_is_cut_back(tiny_window_model_path, tmp_path, baked_model_path):
    """The tiny two-group model (a window of 8 tokens, pages of 4) drafted by a shallower one of the same shape: the
    draft's windows slide past pages while it runs ahead, and a shadow cut back after a refusal recomputes rather
    than read a page its window dropped."""
    import transformers as tf

    from tests.engine.conftest import WINDOW
    from tests.engine.core.engine_run import random_prompts

    config = tf.Qwen2Config(
        **ENGINE_TINY, num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    draft = _save_tiny_engine_model(config, tmp_path / "draft", baked_model_path)
    loop = [7, 8, 9, 10, 11] * 4
    requests = {f"p{i}": (p, greedy(30, ignore_eos=True)) for i, p in enumerate(random_prompts(3, 5, 30, seed=4))}
    requests["loop"] = (loop, greedy(30, ignore_eos=True))
    plain = make_engine(tiny_window_model_path, page_size=4)
    spec = make_engine(tiny_window_model_path, page_size=4, speculative=_draft(draft))
    assert _tokens(run(plain, requests)) == _tokens(run(spec, requests))
    assert 0 < spec.stats()["spec_acceptance_rate"] < 1  # some proposals refused: shadows were cut back
    spec.speculator.proposer.kv.check()
