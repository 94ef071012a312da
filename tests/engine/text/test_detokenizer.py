"""Incremental detokenization with the real SmolLM2 tokenizer: UTF-8 holdback, stop strings, special tokens, and
added tokens (Qwen's `<think>`, `<tool_call>`) whose text must come out exactly as transformers decodes it."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text.detokenizer import Detokenizer, token_bytes, token_text
from engine.text.tokenizer import BAKE_MARK, Tokenizer, load_tokenizer

KOREAN_EMOJI = "안녕하세요, 세계! 오늘 날씨가 정말 좋네요 😀🎉👍🏽 가족: 👨‍👩‍👧‍👦 끝."


@pytest.fixture(scope="module")
def tok(baked_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(baked_model_path)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: Detokenizer, ids: list[int]) -> list[str]:
    """Push one id at a time until a stop string matches; returns the deltas (flush last when no stop)."""
    deltas = []
    for tid in ids:
        delta = detok.push([tid])
        deltas.append(delta.text)
        if delta.stop_string is not None:
            return deltas
    deltas.append(detok.flush())
    return deltas


TEXTS = [KOREAN_EMOJI, "Plain ASCII, with  two spaces.\nAnd a line.", "😀" * 5 + "中文字符"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tok, text: str) -> None:
    ids = encode(tok, text)
    assert len(ids) > len(text) // 4  # the multi-byte characters really are split across tokens
    detok = Detokenizer(tokenizer=tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.output_text == text
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_context_does_not_change_the_output(tok) -> None:
    prompt = encode(tok, "Translate: 안녕")
    ids = encode(tok, " 하세요 😀 ok")
    detok = Detokenizer(tokenizer=tok, prompt_token_ids=prompt)
    assert "".join(stream(detok, ids)) == tok.decode(ids)


def test_each_push_decodes_a_short_window_only(tok) -> None:
    calls: list[int] = []

    class Counting:
        added_tokens_decoder = tok.added_tokens_decoder

        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = encode(tok, KOREAN_EMOJI * 6)
    assert "".join(stream(Detokenizer(tokenizer=Counting()), ids)) == KOREAN_EMOJI * 6
    assert max(calls) <= 8 < len(ids)


def test_invalid_bytes_are_held_then_flushed(tok) -> None:
    lone_lead_byte = encode(tok, "안")[0]  # 0xEC: the first byte of a 3-byte character
    detok = Detokenizer(tokenizer=tok)
    assert detok.push(encode(tok, "ab")).text == "ab"
    assert detok.push([lone_lead_byte]).text == ""
    assert detok.flush() == "\ufffd"


def test_stop_string_spanning_tokens_is_never_emitted(tok) -> None:
    text = "Hello world, this is the end of it. More text"
    ids = encode(tok, text)
    detok = Detokenizer(tokenizer=tok, stop=["the end"])
    deltas = stream(detok, ids)
    assert detok.stopped == "the end"
    assert "".join(deltas) == detok.output_text == "Hello world, this is "
    with pytest.raises(RuntimeError):
        detok.push(ids[:1])


def test_stop_string_inside_a_token_and_include_stop(tok) -> None:
    ids = encode(tok, "Hello world, again")
    detok = Detokenizer(tokenizer=tok, stop=["lo wo"])
    assert "".join(stream(detok, ids)) == "Hel"
    detok = Detokenizer(tokenizer=tok, stop=["xyz", "lo wo"], include_stop_str_in_output=True)
    deltas = stream(detok, ids)
    assert "".join(deltas) == "Hello wo"
    assert detok.stopped == "lo wo"


def test_earliest_stop_string_wins(tok) -> None:
    detok = Detokenizer(tokenizer=tok, stop=["world", "Hello"])
    assert "".join(stream(detok, encode(tok, "Say Hello world"))) == "Say "
    assert detok.stopped == "Hello"


def test_stop_on_a_split_emoji(tok) -> None:
    ids = encode(tok, "좋아요 😀🎉 끝")
    detok = Detokenizer(tokenizer=tok, stop=["🎉"])
    deltas = stream(detok, ids)
    assert "".join(deltas) == "좋아요 😀"
    assert not any("\ufffd" in d for d in deltas)


def test_text_that_may_begin_a_stop_is_held_then_flushed(tok) -> None:
    ids = encode(tok, "Wait for the end")
    detok = Detokenizer(tokenizer=tok, stop=["the endless"])
    deltas = [detok.push([t]).text for t in ids]
    assert "".join(deltas) == "Wait for "  # " the end" could still become the stop string
    assert detok.flush() == "the end"
    assert detok.output_text == "Wait for the end"


def test_special_tokens(tok) -> None:
    ids = [1] + encode(tok, "hi there") + [2]
    assert "".join(stream(Detokenizer(tokenizer=tok), ids)) == "hi there"
    raw = Detokenizer(tokenizer=tok, skip_special_tokens=False)
    expected = "<|im_start|>hi there<|im_end|>"
    assert "".join(stream(raw, ids)) == tok.decode(ids, skip_special_tokens=False) == expected


def test_token_text_and_bytes(tok) -> None:
    ids = encode(tok, "안 world")
    assert b"".join(token_bytes(tok, t) for t in ids) == "안 world".encode()
    assert token_text(tok, ids[-1]) == " world"
    # A token that is one byte of a multi-byte character is shown escaped, as OpenAI's logprobs do.
    assert token_text(tok, ids[0]) == "\\xec"
    assert token_text(tok, 2) == "<|im_end|>"


def test_before_min_tokens_a_stop_string_neither_matches_nor_holds(tok) -> None:
    ids = encode(tok, "the end, then the end again")
    detok = Detokenizer(tokenizer=tok, stop=["the end"])
    early = "".join(detok.push([t], check_stop=False).text for t in ids[:4])
    assert early == tok.decode(ids[:4]) and detok.stopped is None  # released whole, "the end" included
    rest = stream(detok, ids[4:])
    assert detok.stopped == "the end"
    assert early + "".join(rest) == detok.output_text
    assert detok.output_text == "the end, then "


# Qwen3's and Qwen2.5's reasoning and tool-call tokens are added tokens that are not special; DeepSeek's are special.
NOT_SPECIAL = ["<think>", "</think>", "<tool_call>"]
SPECIAL = ["<|tool_sep|>", "<｜Assistant｜>"]
REASONING = '<think>\nOkay, 2 plus 2.</think>\n\nThe answer is 4.<tool_call>{"a": 1}'


@pytest.fixture(scope="module")
def with_added(baked_model_path, tmp_path_factory) -> dict:
    """The default tokenizer plus added tokens, special and not, saved as a bake saves it: ours and transformers'."""
    from transformers import AddedToken, AutoTokenizer

    folder = tmp_path_factory.mktemp("added-tokens")
    ref = AutoTokenizer.from_pretrained(baked_model_path)
    ref.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    ref.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL], special_tokens=True)
    ref.save_pretrained(folder)
    (folder / "manifest.json").write_text(json.dumps({BAKE_MARK: "transformers"}))
    ours = load_tokenizer(str(folder))
    assert isinstance(ours, Tokenizer)
    return {"ours": ours, "transformers": ref}


@pytest.mark.parametrize("side", ["ours", "transformers"])
@pytest.mark.parametrize("skip", [True, False])
def test_added_tokens_keep_the_text_around_them(with_added, side: str, skip: bool) -> None:
    ref = with_added["transformers"]
    ids = encode(ref, REASONING + "<|tool_sep|>")
    assert {ref.convert_tokens_to_ids(t) for t in NOT_SPECIAL} <= set(ids)
    want = REASONING if skip else REASONING + "<|tool_sep|>"
    assert ref.decode(ids, skip_special_tokens=skip) == want
    detok = Detokenizer(tokenizer=with_added[side], skip_special_tokens=skip)
    assert "".join(stream(detok, ids)) == detok.output_text == want


def _pieces():
    added = st.sampled_from(NOT_SPECIAL + SPECIAL + ["<|im_start|>", "<|im_end|>"])
    words = st.sampled_from(["\n", " ", "Okay", " 2", ".", '{"a": 1}', "é", " 日本", "😀", "👨‍👩‍👧", "안녕"])
    return st.lists(st.one_of(added, words, st.text(max_size=6)), max_size=14)


@settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=_pieces(),
    pieces=_pieces(),
    chunk=st.integers(1, 4),
    skip=st.booleans(),
    side=st.sampled_from(["ours", "transformers"]),
)
def test_any_stream_joins_to_transformers_decode(with_added, prompt, pieces, chunk, skip, side) -> None:
    ref = with_added["transformers"]
    # Each piece encoded on its own, so added tokens meet every kind of neighbour, split characters included.
    ids = [i for piece in pieces for i in encode(ref, piece)]
    detok = Detokenizer(
        tokenizer=with_added[side], skip_special_tokens=skip, prompt_token_ids=encode(ref, "".join(prompt))
    )
    deltas = [detok.push(ids[at : at + chunk]).text for at in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(deltas) == detok.output_text == ref.decode(ids, skip_special_tokens=skip)
