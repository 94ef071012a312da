"""LLMEngine end to end on CPU: parity with transformers, batching invariance, prefix cache, preemption,
chunked prefill, sampling, stops, n / best_of / beams, aborts and the context limit.

The tests run a tiny random-weight Llama with SmolLM2's tokenizer (fast); test_engine_smollm2.py runs the baked
SmolLM2 itself. Every run checks after each step that the KV pool neither grew nor leaked a page.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.engine import LLMEngine
from engine.errors import ContextTooLong
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import Choice, greedy, make_engine, random_prompts, run


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return make_engine(tiny_model_path, page_size=4, enable_prefix_caching=False)


def alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Choice:
    return run(engine, {"x": (prompt, params)})["x"].choices[0]


def test_batch_of_16_mixed_lengths_equals_each_alone(tiny, tiny_model_path):
    prompts = random_prompts(16, 1, 60, seed=2)
    params = [greedy(3 + i % 10, ignore_eos=True) for i in range(16)]
    expected = [alone(tiny, p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    engine = make_engine(tiny_model_path, page_size=4)
    got = run(
        engine,
        {str(i): (p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))},
        join_at={str(i): i % 5 for i in range(16)},
    )  # requests also join mid-flight
    assert [got[str(i)].choices[0].token_ids for i in range(16)] == expected


def test_prefix_cache_hit_is_not_recomputed(tiny, tiny_model_path):
    engine = make_engine(tiny_model_path, page_size=16)
    prefix = random_prompts(1, 48, 48, seed=3)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    run(engine, {"a": (first, greedy(4, ignore_eos=True))})
    before = engine.runner.num_tokens_run
    res = run(engine, {"b": (second, greedy(6, ignore_eos=True))})["b"]
    assert res.last.num_cached_tokens == 48
    assert engine.runner.num_tokens_run - before == len(second) - 48 + 6 - 1  # the last token is never fed
    assert res.choices[0].token_ids == alone(tiny, second, greedy(6, ignore_eos=True)).token_ids
    # prompt_logprobs need every prompt position computed: such a request skips the cache.
    res = run(engine, {"c": (second, greedy(2, prompt_logprobs=1))})["c"]
    assert res.last.num_cached_tokens == 0 and all(p is not None for p in res.first.prompt_logprobs[1:])


def test_preemption_with_a_tiny_pool_gives_the_same_tokens(tiny, tiny_model_path):
    prompts = random_prompts(6, 8, 14, seed=4)
    params = greedy(18, ignore_eos=True)
    expected = [alone(tiny, p, params).token_ids for p in prompts]
    engine = make_engine(tiny_model_path, page_size=4, num_kv_pages=14, max_model_len=40)
    got = run(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert engine.scheduler.num_preemptions > 0
    assert [got[str(i)].choices[0].token_ids for i in range(6)] == expected


def test_a_preempted_group_of_choices_shares_its_prompt_again_when_it_returns(tiny, tiny_model_path):
    # "g" (4 seeded choices of a 40-token prompt) fits the 30-page pool only because its choices share the
    # prompt's 10 pages, as the fork made them. "a", admitted first, grows until "g" is preempted by recompute.
    # Back, "g" must share its prompt again: computed once per choice it needs 44 pages and fails as too large
    # (prefix caching is off, so no cache hit covers for it).
    prompt = random_prompts(1, 40, 40, seed=14)[0]
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=8, ignore_eos=True)
    expected = run(tiny, {"g": (prompt, params)})["g"]
    engine = make_engine(tiny_model_path, page_size=4, num_kv_pages=30, max_model_len=96, enable_prefix_caching=False)
    first = random_prompts(1, 44, 44, seed=15)[0]
    got = run(engine, {"a": (first, greedy(40, ignore_eos=True)), "g": (prompt, params)})
    assert engine.scheduler.num_preemptions > 0
    tokens = {i: c.token_ids for i, c in got["g"].choices.items()}
    assert tokens == {i: c.token_ids for i, c in expected.choices.items()}


def test_a_preempted_group_shares_its_prompt_again_past_a_partial_prefix_cache_hit(tiny, tiny_model_path):
    # The same with the prefix cache on: "a" evicts some of "b"'s cached prompt pages, so each choice of "b"
    # finds only part of its prompt in the cache when it returns; the rest must still be computed once.
    prompt = list(range(200, 232))
    params = greedy(12, n=2, ignore_eos=True)
    expected = run(tiny, {"b": (prompt, params)})["b"]
    engine = make_engine(tiny_model_path, page_size=4, num_kv_pages=16, max_model_len=64)
    got = run(engine, {"a": (list(range(100, 108)), greedy(52, ignore_eos=True)), "b": (prompt, params)})
    assert engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got["b"].choices.values()] == [c.token_ids for c in expected.choices.values()]


def test_chunked_prefill_gives_the_same_tokens(tiny, tiny_model_path):
    prompt = random_prompts(1, 50, 50, seed=5)[0]
    engine = make_engine(tiny_model_path, page_size=4, max_num_batched_tokens=8)
    before = engine.runner.num_tokens_run
    got = run(engine, {"x": (prompt, greedy(5, ignore_eos=True, prompt_logprobs=1))})["x"]
    assert engine.runner.num_tokens_run - before == 50 + 4  # seven chunks, then four decode steps
    ref = run(tiny, {"x": (prompt, greedy(5, ignore_eos=True, prompt_logprobs=1))})["x"]
    assert got.choices[0].token_ids == ref.choices[0].token_ids
    chunked, whole = got.first.prompt_logprobs, ref.first.prompt_logprobs
    assert [p.chosen.token_id for p in chunked[1:]] == prompt[1:]
    assert [p.chosen.logprob for p in chunked[1:]] == pytest.approx([p.chosen.logprob for p in whole[1:]], abs=1e-5)


def test_seeded_sampling_is_reproducible_across_batches(tiny):
    prompt = random_prompts(1, 12, 12, seed=6)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    solo = alone(tiny, prompt, params).token_ids
    others = {
        f"o{i}": (p, SamplingParams(temperature=1.0, seed=None if i % 2 else i, max_tokens=4 + i))
        for i, p in enumerate(random_prompts(5, 3, 30, seed=7))
    }
    mixed = run(tiny, {"x": (prompt, params)} | others)
    assert mixed["x"].choices[0].token_ids == solo
    # Choice 0 of n draws from the seed's own stream; the others from streams derived from (seed, i).
    many = run(tiny, {"n": (prompt, SamplingParams(**{**params.__dict__, "n": 3}))})["n"]
    assert many.choices[0].token_ids == solo
    assert len({tuple(c.token_ids) for c in many.choices.values()}) == 3
    other_seed = SamplingParams(**{**params.__dict__, "seed": 99})
    assert alone(tiny, prompt, other_seed).token_ids != solo


def unstopped_run(engine: LLMEngine) -> tuple[list[int], Choice, str]:
    """A prompt, its 24 greedy tokens, and a 3-character piece of their text (after the first 4 characters)
    that occurs there for the first time: a stop string that will cut the text there."""
    prompt = random_prompts(1, 10, 10, seed=8)[0]
    full = alone(engine, prompt, greedy(24, ignore_eos=True))
    text = full.text
    stop = next(
        text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )
    return prompt, full, stop


def test_stop_strings_and_stop_token_ids(tiny):
    prompt, full, stop = unstopped_run(tiny)
    text = full.text
    cut = text.find(stop)
    got = alone(tiny, prompt, greedy(24, ignore_eos=True, stop=[stop]))
    assert (got.text, got.finish_reason, got.stop_reason) == (text[:cut], "stop", stop)
    kept = alone(tiny, prompt, greedy(24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert kept.text == text[: cut + len(stop)]
    token = full.token_ids[5]
    first = full.token_ids.index(token)
    by_id = alone(tiny, prompt, greedy(24, ignore_eos=True, stop_token_ids=[token]))
    assert by_id.token_ids == full.token_ids[: first + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", token)


def test_stop_strings_wait_for_min_tokens(tiny):
    prompt, full, stop = unstopped_run(tiny)
    text = full.text
    # The first token whose text reaches past the stop string's first occurrence.
    end = text.find(stop) + len(stop)
    upto = next(n for n in range(1, 25) if len(tiny.tokenizer.decode(full.token_ids[:n])) >= end)
    got = alone(tiny, prompt, greedy(24, ignore_eos=True, stop=[stop], min_tokens=upto + 1))
    assert len(got.token_ids) >= upto + 1 and got.text.startswith(text[:end])
    assert got.token_ids == full.token_ids[: len(got.token_ids)]
    assert got.finish_reason == "length" or (got.finish_reason, got.stop_reason) == ("stop", stop)


def test_eos_min_tokens_and_ignore_eos(tiny):
    prompt = [5, 6, 7]
    forced = {2: 100.0}  # makes <|im_end|> (eos) the best token every step
    got = alone(tiny, prompt, greedy(10, logit_bias=forced))
    assert (got.token_ids, got.finish_reason, got.stop_reason) == ([2], "stop", None)
    got = alone(tiny, prompt, greedy(10, logit_bias=forced, min_tokens=3))
    assert len(got.token_ids) == 4 and got.token_ids[-1] == 2 and 2 not in got.token_ids[:3]
    got = alone(tiny, prompt, greedy(10, logit_bias=forced, ignore_eos=True))
    assert got.token_ids == [2] * 10 and got.finish_reason == "length"


def test_n_best_of_and_usage(tiny):
    prompt = random_prompts(1, 9, 9, seed=9)[0]
    base = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)
    four = run(tiny, {"x": (prompt, SamplingParams(n=4, **base))})["x"]
    assert four.last.num_generated_tokens == 24 and four.last.num_prompt_tokens == 9
    totals = {tuple(c.token_ids): sum(lp.chosen.logprob for lp in c.logprobs) for c in four.choices.values()}
    best = run(tiny, {"y": (prompt, SamplingParams(n=2, best_of=4, **base))})["y"]
    assert best.outputs == 1  # best_of > n: one final output
    want = sorted(totals, key=totals.get, reverse=True)[:2]
    assert [tuple(best.choices[i].token_ids) for i in range(2)] == want


def test_beam_search_returns_the_best_beams(tiny, tiny_model_path):
    import transformers as tf

    prompt = random_prompts(1, 7, 7, seed=10)[0]
    got = run(
        tiny,
        {
            "b": (
                prompt,
                SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True),
            )
        },
    )["b"]
    assert got.outputs == 1 and len(got.choices) == 2
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            num_beams=3,
            num_return_sequences=2,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            early_stopping=False,
            length_penalty=1.0,
        )
    assert [got.choices[i].token_ids for i in range(2)] == ref[:, len(prompt) :].tolist()


def test_logprobs_match_transformers(tiny, tiny_model_path):
    import transformers as tf

    prompt = random_prompts(1, 9, 9, seed=11)[0]
    res = run(tiny, {"x": (prompt, greedy(5, ignore_eos=True, logprobs=3, prompt_logprobs=2))})["x"]
    out = res.choices[0]
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), dim=-1)
    for j, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + j]
        assert lp.chosen.token_id == out.token_ids[j] == int(row.argmax())
        assert lp.chosen.logprob == pytest.approx(float(row[lp.chosen.token_id]), abs=1e-4)
        assert [t.token_id for t in lp.top] == row.topk(3).indices.tolist()
        assert lp.chosen.token == tiny.tokenizer.decode([lp.chosen.token_id])
    first = res.first.prompt_logprobs  # sent once, with the first output
    assert all(o is None for o in [res.last.prompt_logprobs]) and res.outputs == 5
    assert first[0] is None and len(first) == len(prompt)
    for pos in range(1, len(prompt)):
        row = ref[pos - 1]
        assert first[pos].chosen.token_id == prompt[pos]
        assert first[pos].chosen.logprob == pytest.approx(float(row[prompt[pos]]), abs=1e-4)
        assert [t.token_id for t in first[pos].top] == row.topk(2).indices.tolist()


def test_abort_frees_pages_at_once(tiny):
    for i, p in enumerate(random_prompts(3, 20, 30, seed=12)):
        tiny.add_request(str(i), p, greedy(50, ignore_eos=True))
    for _ in range(3):
        tiny.step()
    free = tiny.allocator.num_free
    last = tiny.abort("1")
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert tiny.allocator.num_free > free
    tiny.abort("0")
    tiny.abort("2")
    assert not tiny.has_unfinished() and tiny.allocator.num_free == tiny.allocator.num_pages
    assert tiny.abort("0") is None


def test_context_limit(tiny_model_path):
    engine = make_engine(tiny_model_path, page_size=4, max_model_len=32)
    with pytest.raises(ContextTooLong) as err:
        engine.add_request("a", list(range(3, 35)), greedy(1))
    assert err.value.param == "prompt"
    with pytest.raises(ContextTooLong) as err:
        engine.add_request("b", list(range(3, 31)), greedy(5))
    assert err.value.param == "max_tokens"
    assert not engine.has_unfinished()
    res = run(
        engine,
        {
            "c": (list(range(3, 103)), greedy(4, truncate_prompt_tokens=10, ignore_eos=True)),
            "d": (list(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)),
        },
    )
    assert res["c"].last.num_prompt_tokens == 10 and res["c"].last.prompt_token_ids == list(range(93, 103))
    assert len(res["d"].choices[0].token_ids) == 32 - 20 and res["d"].choices[0].finish_reason == "length"


def test_a_failing_request_fails_alone(tiny, monkeypatch):
    """Fault injection: the sampler raises for one request's rows; the others finish as if alone."""
    prompts = random_prompts(3, 5, 9, seed=13)
    expected = [alone(tiny, p, greedy(6, ignore_eos=True)).token_ids for p in prompts]
    real = tiny.runner.sampler.__class__.__call__

    def flaky(self, logits, rows):
        if any(r.params.max_tokens == 7 for r in rows):
            raise ValueError("injected")
        return real(self, logits, rows)

    monkeypatch.setattr(tiny.runner.sampler.__class__, "__call__", flaky)
    for i, p in enumerate(prompts):
        tiny.add_request(str(i), p, greedy(6, ignore_eos=True))
    tiny.add_request("bad", prompts[0], greedy(7, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    failures = []
    while tiny.has_unfinished():
        for out in tiny.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        failures += tiny.pop_failures()
    assert [(r, str(e)) for r, e in failures] == [("bad", "injected")]
    assert [tokens[str(i)] for i in range(3)] == expected
    assert tiny.allocator.num_free == tiny.allocator.num_pages
