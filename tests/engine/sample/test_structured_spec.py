"""Structured outputs without a model run: the spec's checks and rewrites, the compile cache, the token mask."""

from __future__ import annotations

import re

import pytest
import torch

from engine.errors import InvalidRequest
from engine.sample.structured.bitmask import apply_bitmask, grammar_bitmask
from engine.sample.structured.compiler import GrammarCache, tokenizer_info
from engine.sample.structured.matcher import GrammarState
from engine.sample.structured.rewrite import lengths_as_patterns
from engine.sample.structured.spec import StructuredSpec
from engine.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(str(tiny_model_path))


@pytest.mark.parametrize(
    "schema, param_fragment",
    [
        ({"type": "object", "not": {"required": ["a"]}}, "'not'"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"const": 1}}, "contains"),
        ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
        ({"type": "object", "properties": {"a": {"if": {"const": 1}, "then": {}}}}, "'if'"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
        ({"$defs": {"x": {"propertyNames": {"pattern": "a"}}}}, "propertyNames"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "'maxLength' together with 'pattern'"),
    ],
)
def test_unsupported_schema_keywords_are_refused(schema, param_fragment) -> None:
    with pytest.raises(InvalidRequest) as info:
        StructuredSpec.json_schema(schema, "response_format")
    assert info.value.param == "response_format" and param_fragment in info.value.message


def test_spec_checks_without_a_compiler() -> None:
    # A property may be called like a keyword: only sub-schemas are walked.
    StructuredSpec.json_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {}}}, "p")
    StructuredSpec.json_schema({"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer"}}}, "p")
    for make, param in [
        (lambda: StructuredSpec.json_schema("{not json", "guided_json"), "guided_json"),
        (lambda: StructuredSpec.json_schema([1, 2], "json_schema"), "json_schema"),
        (lambda: StructuredSpec.choice([], "guided_choice"), "guided_choice"),
        (lambda: StructuredSpec(kind="regex", value="", param="regex"), "regex"),
        (
            lambda: StructuredSpec(kind="structural_tag", value="{", param="structured_outputs.structural_tag"),
            "structured_outputs.structural_tag",
        ),
    ]:
        with pytest.raises(InvalidRequest) as info:
            make()
        assert info.value.param == param
    assert StructuredSpec(kind="regex", value="a", param="x") == StructuredSpec(
        kind="regex", value="a", param="y"
    )  # the cache key


def test_length_bounds_become_patterns_with_the_same_strings() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 2, "maxLength": 4},
            "b": {"type": ["string", "null"], "maxLength": 3},
            "c": {"type": "string", "enum": ["long enough"], "maxLength": 2},
            "d": {"type": "integer", "maximum": 3},
        },
    }
    out = lengths_as_patterns(schema)
    assert "maxLength" not in out["properties"]["a"] and out["properties"]["a"]["pattern"].endswith("{2,4}$")
    assert out["properties"]["b"]["pattern"].endswith("{0,3}$")
    assert out["properties"]["c"] == schema["properties"]["c"] and out["properties"]["d"] == schema["properties"]["d"]
    pattern = re.compile(out["properties"]["a"]["pattern"])
    for text, ok in (
        ("ab", True),
        ("abcd", True),
        ("a", False),
        ("abcde", False),
        ("a\x07", False),
        ('a"', False),
        ("ü€", True),
    ):
        assert bool(pattern.search(text)) == ok, text


def test_compile_cache_is_bounded_and_shared(tokenizer) -> None:
    cache = GrammarCache(tokenizer=tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2], capacity=2)
    specs = [StructuredSpec(kind="regex", value=f"a{{{i}}}", param="regex") for i in range(1, 4)]
    first = cache.submit(specs[0])
    assert cache.submit(StructuredSpec(kind="regex", value="a{1}", param="other")) is first
    first.result()
    for spec in specs[1:]:
        cache.get(spec)
    assert cache.num_compiled == 3 and len(cache._cache) == 2
    cache.get(specs[0])  # evicted, so compiled again
    assert cache.num_compiled == 4
    cache.shutdown()


def test_special_and_padding_ids_are_never_allowed(tokenizer) -> None:
    tok = tokenizer
    vocab = len(tok) + 40  # an lm_head padded past the tokenizer's table
    info = tokenizer_info(tok, vocab, [2])
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, max_threads=1)
    state = GrammarState.start(compiler.compile_json_schema('{"type": "string"}'))
    state.accept(tok.convert_tokens_to_ids('"'))
    bits = grammar_bitmask([state], vocab)[0]
    allowed = {j for j in range(vocab) if (int(bits[j // 32]) >> (j % 32)) & 1}
    assert tok.convert_tokens_to_ids("a") in allowed
    assert not allowed & set(tok.all_special_ids), "special tokens would vanish from the text"
    assert not allowed & set(range(len(tok), vocab)), "padding ids"


def test_the_mask_equals_xgrammars_cpu_kernel_and_a_plain_loop() -> None:
    import xgrammar as xgr

    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32)
    for rows in ([0, 2, 4], [0, 1, 2, 3, 4]):
        ours = logits.clone()
        apply_bitmask(ours, bitmask[rows], rows)
        kernel = logits.clone()
        xgr.apply_token_bitmask_inplace(kernel, bitmask, vocab_size=100, indices=rows, backend="cpu")
        assert torch.equal(ours, kernel)
        expected = logits.clone()
        for k, i in enumerate(rows):
            for j in range(100):
                if not (int(bitmask[rows][k, j // 32]) >> (j % 32)) & 1:
                    expected[i, j] = float("-inf")
        assert torch.equal(ours, expected)
