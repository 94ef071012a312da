"""What the engine says when its KV cache is too small: at start-up for one sequence of max_model_len (a
setting to change), and per request for several sequences that outgrow it together (the client's n)."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest, StartupError
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import make_engine, random_prompts


def test_a_pool_smaller_than_one_sequence_of_max_model_len_stops_start_up(tiny_model_path):
    with pytest.raises(
        StartupError,
        match=r"cannot hold one sequence of max_model_len=96 tokens: lower "
        r"max_model_len to at most 32, or raise num_kv_pages",
    ) as err:
        make_engine(tiny_model_path, page_size=4, num_kv_pages=8, max_model_len=96)
    assert err.value.param == "max_model_len"
    with pytest.raises(StartupError, match="above the model's limit of 512"):
        make_engine(tiny_model_path, max_model_len=4096)


def test_sequences_outgrowing_the_pool_together_fail_as_the_requests_n(tiny_model_path):
    # 8 choices of a 20-token prompt growing to 36 tokens each need far more than 14 pages of 4 tokens, though
    # one of them alone (or one sequence of max_model_len=40) fits.
    engine = make_engine(tiny_model_path, page_size=4, num_kv_pages=14, max_model_len=40)
    prompt = random_prompts(1, 20, 20, seed=3)[0]
    engine.add_request("many", prompt, SamplingParams(temperature=1.0, seed=1, n=8, max_tokens=16, ignore_eos=True))
    engine.add_request("one", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    [(request_id, exc)] = engine.pop_failures()
    assert request_id == "many" and isinstance(exc, InvalidRequest) and exc.param == "n"
    assert "cannot hold this request's 8 sequences at once: lower n, best_of or max_tokens" in exc.message
    assert list(finished) == ["one"]
    assert engine.allocator.num_free == engine.allocator.num_pages
