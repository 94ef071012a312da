"""Speculative decoding with n-gram lookup on the baked SmolLM2 (float32): greedy output token for token as without
it (prompts that repeat and prompts that do not, batched with requests that cannot speculate), and everything that
ends or cuts a choice (stop strings and ids, max_tokens mid-proposal, aborts, preemption, n=2, logprobs,
penalties) as without it."""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import greedy, make_engine, run

TEXT = (
    "The committee met on Tuesday to review the budget. It approved the new library, the park repairs and the "
    "bus route, and it asked the mayor to report back in June."
)
# Speculating at every batch size these tests run (the default turns it off above 4 decoding sequences).
NGRAM = SpeculativeConfig(
    method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2, disable_by_batch_size=256
)


@pytest.fixture(scope="module")
def engines(baked_model_path):
    plain = make_engine(baked_model_path, num_kv_pages=512)
    spec = make_engine(baked_model_path, num_kv_pages=512, speculative=NGRAM)
    return plain, spec


@pytest.fixture(scope="module")
def prompts(engines):
    tok = engines[0].tokenizer
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return {
        "repeat": tok.encode(chat.format(f"Repeat this text exactly:\n{TEXT}")),
        "edit": tok.encode(chat.format(f"Rewrite this text with 'Tuesday' replaced by 'Monday':\n{TEXT}")),
        "free": tok.encode("Once upon a time, in a small village,"),
        "code": tok.encode("def fibonacci(n):"),
    }


def _tokens(results) -> dict[str, list[list[int]]]:
    return {r: [c.token_ids for _, c in sorted(res.choices.items())] for r, res in results.items()}


def _both(engines, requests, **kw):
    plain, spec = engines
    before = spec.stats()["spec_accepted_tokens"]
    a, b = run(plain, requests, **kw), run(spec, requests, **kw)
    return a, b, spec.stats()["spec_accepted_tokens"] - before


def test_greedy_equals_without_speculation_on_prompts_that_repeat_and_do_not(engines, prompts):
    requests = {name: (p, greedy(40)) for name, p in prompts.items()}
    # Requests that cannot speculate share the steps: beam search.
    requests["beam"] = (prompts["free"], SamplingParams(temperature=0.0, max_tokens=12, n=2, use_beam_search=True))
    a, b, accepted = _both(engines, requests, join_at={"code": 3, "beam": 5})
    assert _tokens(a) == _tokens(b)
    assert [c.text for c in a["repeat"].choices.values()] == [c.text for c in b["repeat"].choices.values()]
    assert accepted > 20  # the repeated text was mostly accepted, not recomputed token by token


def test_max_tokens_cut_mid_proposal_and_stops_drop_what_follows(engines, prompts):
    plain_out = run(engines[0], {"r": (prompts["repeat"], greedy(40))})["r"].choices[0]
    words = plain_out.text.split()
    stop = " ".join(words[6:8])  # a stop string inside the repeated text
    stop_id = plain_out.token_ids[13]
    requests = {f"max{m}": (prompts["repeat"], greedy(m)) for m in (1, 2, 3, 5, 6, 7, 11)}
    requests["stop"] = (prompts["repeat"], greedy(40, stop=[stop]))
    requests["stop_kept"] = (prompts["repeat"], greedy(40, stop=[stop], include_stop_str_in_output=True))
    requests["stop_id"] = (prompts["repeat"], greedy(40, stop_token_ids=[stop_id]))
    a, b, accepted = _both(engines, requests)
    assert accepted > 0
    for r in requests:
        x, y = a[r].choices[0], b[r].choices[0]
        assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
            x.token_ids,
            x.text,
            x.finish_reason,
            x.stop_reason,
        ), r
    for m in (1, 2, 3, 5, 6, 7, 11):
        assert len(b[f"max{m}"].choices[0].token_ids) == m
        assert b[f"max{m}"].last.num_generated_tokens == m
    assert b["stop"].choices[0].finish_reason == "stop" and stop not in b["stop"].choices[0].text


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(engines, prompts):
    requests = {"r": (prompts["repeat"], greedy(24, logprobs=3)), "f": (prompts["free"], greedy(12, logprobs=0))}
    a, b, accepted = _both(engines, requests)
    assert accepted > 0
    for r in requests:
        x, y = a[r].choices[0].logprobs, b[r].choices[0].logprobs
        assert len(x) == len(y) == len(a[r].choices[0].token_ids)
        for px, py in zip(x, y, strict=True):
            assert py.chosen.token_id == px.chosen.token_id
            assert py.chosen.logprob == pytest.approx(px.chosen.logprob, abs=1e-4)
            assert [t.token_id for t in py.top] == [t.token_id for t in px.top]
            assert [t.logprob for t in py.top] == pytest.approx([t.logprob for t in px.top], abs=1e-4)


def test_penalties_and_masks_see_the_accepted_tokens_in_order(engines, prompts):
    requests = {
        "rep": (prompts["repeat"], greedy(32, repetition_penalty=1.3)),
        "freq": (prompts["edit"], greedy(32, frequency_penalty=0.5, presence_penalty=0.3)),
        "min": (prompts["repeat"], greedy(32, min_tokens=30)),
        "bias": (prompts["repeat"], greedy(32, logit_bias={13: 3.0})),
    }
    a, b, _ = _both(engines, requests)
    assert _tokens(a) == _tokens(b)


def test_n_2_choices_speculate_each_on_its_own(engines, prompts):
    requests = {"n2": (prompts["repeat"], greedy(30, n=2)), "one": (prompts["repeat"], greedy(30))}
    a, b, accepted = _both(engines, requests)
    assert accepted > 0
    assert _tokens(a) == _tokens(b)
    assert _tokens(b)["n2"] == _tokens(b)["one"] * 2
    sampled = {"s": (prompts["repeat"], SamplingParams(temperature=0.8, max_tokens=20, n=2, seed=7))}
    out = run(engines[1], sampled)["s"]  # run() checks the pool: no page leaked
    assert [len(c.token_ids) for c in out.choices.values()] == [20, 20] or any(
        c.finish_reason == "stop" for c in out.choices.values()
    )


def test_an_abort_after_a_verify_frees_its_pages_and_leaves_the_others_alone(engines, prompts):
    plain, spec = engines
    alone = run(plain, {"k": (prompts["edit"], greedy(30))})["k"].choices[0].token_ids
    spec.add_request("gone", prompts["repeat"], greedy(40))
    spec.add_request("kept", prompts["edit"], greedy(30))
    before = spec.stats()["spec_verify_steps"]
    kept: list[int] = []
    while spec.stats()["spec_verify_steps"] == before:
        for out in spec.step():
            kept += [t for d in out.outputs for t in d.token_ids if out.request_id == "kept"]
    assert spec.abort("gone").finished
    while spec.has_unfinished():
        for out in spec.step():
            kept += [t for d in out.outputs for t in d.token_ids]
        spec.allocator.check()
    assert kept == alone
    assert spec.allocator.num_free == spec.allocator.num_pages


def test_preemption_on_a_small_kv_pool_gives_the_same_tokens(baked_model_path, engines, prompts):
    tight = make_engine(baked_model_path, num_kv_pages=14, max_model_len=160, page_size=16, speculative=NGRAM)
    requests = {
        f"{name}{i}": (p, greedy(30 + 4 * i, ignore_eos=True))
        for i in range(2)
        for name, p in prompts.items()
        if name != "edit"
    }
    a = run(engines[0], requests)
    b = run(tight, requests)
    assert _tokens(a) == _tokens(b)
    assert tight.scheduler.num_preemptions > 0
    assert tight.stats()["spec_accepted_tokens"] > 0


def test_a_second_turn_reads_prefix_pages_that_hold_only_accepted_tokens(engines, prompts):
    """Pages a speculative step filled are cached under the tokens the output kept: a follow-up turn whose prompt
    holds that output hits them and still decodes as an engine without speculation does."""
    plain, spec = engines
    first = run(spec, {"t1": (prompts["repeat"], greedy(40, ignore_eos=True))})["t1"].choices[0].token_ids
    turn = prompts["repeat"] + first + engines[0].tokenizer.encode("\nAgain:")
    a = run(plain, {"t2": (turn, greedy(24))})
    b = run(spec, {"t2": (turn, greedy(24))})
    assert b["t2"].last.num_cached_tokens >= len(prompts["repeat"]) + len(first) - 16
    assert _tokens(a) == _tokens(b)


def test_a_large_batch_turns_speculation_off_for_the_step(baked_model_path, prompts):
    spec = make_engine(
        baked_model_path, num_kv_pages=256, speculative=SpeculativeConfig(method="ngram", disable_by_batch_size=2)
    )
    run(spec, {f"r{i}": (prompts["repeat"], greedy(8)) for i in range(3)})
    stats = spec.stats()
    assert stats["spec_skipped_steps"] > 0 and stats["spec_verify_steps"] == 0


def test_structured_requests_run_without_speculation_beside_those_that_speculate(engines, prompts, caplog):
    from engine.sample.structured.spec import StructuredSpec

    regex = StructuredSpec(kind="regex", value=r"(yes|no|maybe)! [a-z ]{4,12}\.", param="guided_regex")
    requests = {"json": (prompts["repeat"], greedy(24, structured=regex)), "repeat": (prompts["repeat"], greedy(24))}
    with caplog.at_level("INFO", logger="engine.core.spec.speculator"):
        a, b, accepted = _both(engines, requests)
    assert _tokens(a) == _tokens(b) and accepted > 0
    assert "requests with structured output run without it" in caplog.text


def test_sliding_window_pages_follow_accepted_tokens(tiny_window_model_path):
    """A model with a full-attention group and a window group of 8 tokens (pages of 4): proposals cross pages
    and the window, and the output equals plain decoding."""
    from tests.engine.core.engine_run import random_prompts

    loop = [7, 8, 9, 10, 11] * 6  # a prompt that repeats, and random ones
    requests = {f"p{i}": (p, greedy(40, ignore_eos=True)) for i, p in enumerate(random_prompts(4, 5, 30, seed=3))}
    requests["loop"] = (loop, greedy(40, ignore_eos=True))
    plain = make_engine(tiny_window_model_path, page_size=4)
    spec = make_engine(tiny_window_model_path, page_size=4, speculative=NGRAM)
    assert _tokens(run(plain, requests)) == _tokens(run(spec, requests))
    assert spec.stats()["spec_accepted_tokens"] > 0
