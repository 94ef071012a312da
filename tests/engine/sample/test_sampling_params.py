"""SamplingParams validation: each bad value is rejected naming its parameter; good values normalise."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from engine.sample.params import SamplingParams

BAD = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"best_of": 0}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    # Beam search: a width above 1 and deterministic settings, as vLLM requires.
    ({"use_beam_search": True, "temperature": 0.0}, "n"),
    ({"use_beam_search": True, "best_of": 1, "temperature": 0.0}, "best_of"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.0, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.0, "top_k": 5}, "top_k"),
    # Beam-only knobs are errors without beam search, rather than silently ignored.
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
]


@pytest.mark.parametrize("kwargs,param", BAD, ids=[f"{p}:{k}" for k, p in BAD])
def test_invalid_values_name_their_param(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in info.value.message


def test_message_gives_the_bound_and_the_value() -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(temperature=-1)
    assert info.value.message == "temperature must be >= 0.0, got -1"


def test_defaults_are_valid_and_sampled() -> None:
    p = SamplingParams()
    assert not p.greedy and p.num_sequences == 1 and p.max_tokens == 16


def test_greedy_and_num_sequences() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(n=2, best_of=5).num_sequences == 5
    assert SamplingParams(n=3).num_sequences == 3


def test_stop_accepts_a_string_or_a_list() -> None:
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=[]).stop is None
    assert SamplingParams(stop=["", "x"]).stop == ["x"]


def test_logit_bias_keys_from_json_become_ints() -> None:
    p = SamplingParams(logit_bias={"17": -100, 3: 2.5})
    assert p.logit_bias == {17: -100.0, 3: 2.5}


def test_valid_edges_accepted() -> None:
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=0)
    SamplingParams(logprobs=20, prompt_logprobs=0, min_tokens=16, max_tokens=16, seed=-5)
    SamplingParams(max_tokens=None, min_tokens=1000)
    beam = SamplingParams(use_beam_search=True, n=2, best_of=4, temperature=0, length_penalty=0.5, early_stopping=True)
    assert beam.num_sequences == 4 and beam.greedy


def test_check_vocab_rejects_out_of_range_ids() -> None:
    SamplingParams(logit_bias={10: 1}).check_vocab(11)
    for kwargs, param in (
        ({"logit_bias": {11: 1}}, "logit_bias"),
        ({"allowed_token_ids": [0, 11]}, "allowed_token_ids"),
        ({"stop_token_ids": [99]}, "stop_token_ids"),
    ):
        with pytest.raises(InvalidRequest) as info:
            SamplingParams(**kwargs).check_vocab(11)
        assert info.value.param == param
