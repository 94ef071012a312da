"""Structured outputs in the engine: every output of a constrained request matches its grammar, under batching,
n / best_of / beams, preemption, chunked prefill, stops, logprobs; bad grammars fail alone; compiles run aside.

Random-weight models are the strongest check: their logits favour nothing, so only the mask keeps the text
valid. Their schemas bound every string, array and number (tests/structured_schemas.py) and they run with
disable_any_whitespace, or a random model could spend its whole budget on whitespace.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.errors import InvalidRequest
from engine.sample.params import SamplingParams
from engine.sample.structured.spec import StructuredSpec
from tests.engine.core.engine_run import make_engine, run
from tests.structured_schemas import SCHEMAS

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [300, 200, 100]]


def schema_spec(name: str, any_whitespace: bool = False) -> StructuredSpec:
    return StructuredSpec.json_schema(SCHEMAS[name], "response_format", any_whitespace=any_whitespace)


def assert_valid(name: str, text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return make_engine(tiny_model_path, max_num_seqs=64)


@pytest.fixture(scope="module")
def smol(baked_model_path):
    return make_engine(baked_model_path, dtype="float32", num_kv_pages=512)


def test_random_weights_follow_every_schema(tiny) -> None:
    assert len(SCHEMAS) >= 20
    requests = {}
    for i, name in enumerate(SCHEMAS):
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, seed=i, max_tokens=200, structured=schema_spec(name))
            requests[f"{name}@{temperature}"] = (PROMPTS[i % len(PROMPTS)], params)
    results = run(tiny, requests)
    for request_id, result in results.items():
        choice = result.choices[0]
        assert choice.finish_reason == "stop", (request_id, choice.text)
        assert_valid(request_id.split("@")[0], choice.text)


def test_default_model_follows_every_schema(smol) -> None:
    tok = smol.tokenizer
    requests = {}
    for name, schema in SCHEMAS.items():
        messages = [{"role": "user", "content": f"Answer in JSON that follows this schema: {json.dumps(schema)}"}]
        prompt = tok.encode(
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        requests[name] = (prompt, SamplingParams(temperature=0.0, max_tokens=120, structured=schema_spec(name)))
    results = run(smol, requests)
    for name, result in results.items():
        assert result.choices[0].finish_reason == "stop", (name, result.choices[0].text)
        assert_valid(name, result.choices[0].text)


@pytest.mark.parametrize(
    "pattern",
    [
        r"\d{3}-[a-z]{2,4}",
        r"(yes|no|maybe)!",
        r"[A-F]{2}(:[0-9A-F]{2}){2}",
        r"\w+@\w+\.com",
    ],
)
def test_regex_outputs_full_match(tiny, pattern) -> None:
    spec = StructuredSpec(kind="regex", value=pattern, param="guided_regex")
    requests = {
        f"r{seed}": (PROMPTS[seed % 3], SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured=spec))
        for seed in range(6)
    }
    for result in run(tiny, requests).values():
        choice = result.choices[0]
        if choice.finish_reason == "stop":
            assert re.fullmatch(pattern, choice.text), choice.text
        else:  # an unbounded \w+ may run out of tokens: what came out is still a prefix the grammar allows
            assert choice.finish_reason == "length" and pattern == r"\w+@\w+\.com"


def test_choice_outputs_are_exactly_one_choice(tiny) -> None:
    choices = ["red", "green", "dark blue", "N/A", 'say "hi"']
    spec = StructuredSpec.choice(choices, "guided_choice")
    params = SamplingParams(n=8, temperature=1.5, seed=3, max_tokens=20, structured=spec)
    result = run(tiny, {"c": (PROMPTS[0], params)})["c"]
    texts = [result.choices[i].text for i in range(8)]
    assert all(t in choices for t in texts), texts
    assert len(set(texts)) > 1  # each choice drew on its own: the matchers are not shared


def test_ebnf_and_lark_grammars(tiny) -> None:
    ebnf = 'root ::= "(" num (op num){0,3} ")"\nnum ::= [1-9] [0-9]?\nop ::= " + " | " * "'
    lark = 'start: "<" WORD ("," WORD)* ">"\nWORD: /[a-z]{1,5}/'
    expected = {"e": r"\([1-9][0-9]?(( \+ | \* )[1-9][0-9]?){0,3}\)", "l": r"<[a-z]{1,5}(,[a-z]{1,5})*>"}
    requests = {}
    for seed in range(4):
        requests[f"e{seed}"] = (
            PROMPTS[seed % 3],
            SamplingParams(
                temperature=1.0,
                seed=seed,
                max_tokens=40,
                structured=StructuredSpec(kind="grammar", value=ebnf, param="ebnf"),
            ),
        )
        requests[f"l{seed}"] = (
            PROMPTS[seed % 3],
            SamplingParams(
                temperature=0.0 if seed == 0 else 1.0,
                seed=seed,
                max_tokens=60,
                structured=StructuredSpec(kind="grammar", value=lark, param="guided_grammar"),
            ),
        )
    for request_id, result in run(tiny, requests).items():
        choice = result.choices[0]
        assert choice.finish_reason in ("stop", "length"), choice
        if request_id.startswith("e") or choice.finish_reason == "stop":
            assert choice.finish_reason == "stop" and re.fullmatch(expected[request_id[0]], choice.text), choice.text


def test_structural_tags_new_and_legacy_formats(tiny) -> None:
    point = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"],
        "additionalProperties": False,
    }
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "end": "</answer>",
            "content": {"type": "regex", "pattern": "[a-z]{1,5}=[0-9]"},
        },
    }
    spec = StructuredSpec(kind="structural_tag", value=json.dumps(tag), param="structured_outputs")
    requests = {
        f"t{seed}": (PROMPTS[seed % 3], SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured=spec))
        for seed in range(3)
    }
    for result in run(tiny, requests).values():
        text = result.choices[0].text
        assert result.choices[0].finish_reason == "stop", text
        assert re.fullmatch(r"<answer>[a-z]{1,5}=[0-9]</answer>", text), text
    legacy = {
        "type": "structural_tag",
        "triggers": ["<f>"],
        "structures": [{"begin": "<f>", "schema": point, "end": "</f>"}],
    }
    assert tiny.grammars.get(StructuredSpec(kind="structural_tag", value=json.dumps(legacy), param="s")) is not None
    with pytest.raises(InvalidRequest) as info:
        tiny.grammars.get(
            StructuredSpec(
                kind="structural_tag",
                value='{"type": "structural_tag", "format": {"type": "nope"}}',
                param="structured_outputs.structural_tag",
            )
        )
    assert info.value.param == "structured_outputs.structural_tag"


def test_unconstrained_requests_are_bit_identical_next_to_constrained_ones(tiny) -> None:
    plain = {
        f"p{i}": (prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2))
        for i, prompt in enumerate(PROMPTS)
    }
    alone = {r: run(tiny, {r: request})[r].choices[0] for r, request in plain.items()}
    mixed = dict(plain)
    for i, name in enumerate(["nested_objects", "array_of_objects", "ref_defs", "number_range"]):
        mixed[name] = (PROMPTS[i % 3], SamplingParams(temperature=0.0, max_tokens=200, structured=schema_spec(name)))
    together = run(tiny, mixed)
    for r, choice in alone.items():
        # Tokens and text, bit for bit (logprobs shift in the last digits with the batch size, masks or not).
        assert together[r].choices[0].token_ids == choice.token_ids
        assert together[r].choices[0].text == choice.text
    for name in ("nested_objects", "array_of_objects", "ref_defs", "number_range"):
        assert_valid(name, together[name].choices[0].text)


def test_n_best_of_and_beam_search_keep_one_matcher_per_choice(tiny) -> None:
    spec = schema_spec("array_of_objects")
    requests = {
        "n": (PROMPTS[0], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=200, structured=spec)),
        "best_of": (
            PROMPTS[1],
            SamplingParams(n=2, best_of=4, temperature=1.0, seed=2, max_tokens=200, structured=spec),
        ),
        "beam": (
            PROMPTS[2],
            SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=200, structured=spec),
        ),
    }
    results = run(tiny, requests)
    assert [len(results[r].choices) for r in requests] == [4, 2, 2]
    for r, result in results.items():
        for choice in result.choices.values():
            assert choice.finish_reason == "stop", (r, choice.text)
            assert_valid("array_of_objects", choice.text)
    assert len({c.text for c in results["n"].choices.values()}) > 1


def test_preemption_and_chunked_prefill_keep_the_matcher_state(tiny_model_path) -> None:
    names = ["nested_objects", "array_of_objects", "ref_defs", "tuple_prefix_items", "matrix", "number_range"]
    long_prompt = list(range(100, 190))

    def requests() -> dict:
        return {
            name: (
                long_prompt if i % 2 else PROMPTS[i % 3],
                SamplingParams(
                    n=2 if i == 0 else 1, temperature=1.0, seed=i, max_tokens=200, structured=schema_spec(name)
                ),
            )
            for i, name in enumerate(names)
        }

    roomy = make_engine(tiny_model_path, num_kv_pages=256)
    reference = run(roomy, requests())
    # 20 pages of 16 tokens cannot hold these six at once (preemption), and 32-token steps chunk the prefills.
    tight = make_engine(tiny_model_path, num_kv_pages=20, max_num_batched_tokens=32)
    squeezed = run(tight, requests())
    assert tight.scheduler.num_preemptions > 0
    for name in names:
        for index, choice in reference[name].choices.items():
            assert squeezed[name].choices[index].token_ids == choice.token_ids, name
            assert choice.finish_reason == "stop"
            assert_valid(name, choice.text)


def test_stops_max_tokens_logprobs_ignore_eos_and_min_tokens(tiny) -> None:
    spec = schema_spec("array_of_objects")
    requests = {
        "cut": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, structured=spec)),
        "stop": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, stop=['"qty"'], structured=spec)),
        "logprobs": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, logprobs=3, structured=spec)),
        "ignore_eos": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, structured=spec)),
        "min_tokens": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, min_tokens=150, structured=spec)),
    }
    results = {r: res.choices[0] for r, res in run(tiny, requests).items()}
    full = results["logprobs"]
    assert results["cut"].finish_reason == "length" and len(results["cut"].token_ids) == 5
    assert full.text.startswith(results["cut"].text)
    assert results["stop"].finish_reason == "stop" and results["stop"].stop_reason == '"qty"'
    assert full.text.startswith(results["stop"].text) and '"qty"' not in results["stop"].text
    assert len(full.logprobs) == len(full.token_ids) and all(len(p.top) == 3 for p in full.logprobs)
    # The grammar's end is a stop even where EOS is ignored or held back: its one allowed token is EOS.
    for r in ("ignore_eos", "min_tokens"):
        assert results[r].finish_reason == "stop" and results[r].text == full.text, r


def test_a_slow_compile_waits_aside_while_others_decode(tiny) -> None:
    # Strings with length bounds are xgrammar's slow case: this one takes about a second here.
    slow = {
        "type": "object",
        "properties": {f"f{i}": {"type": "string", "minLength": i, "maxLength": i + 50} for i in range(100)},
        "required": [f"f{i}" for i in range(100)],
    }
    spec = StructuredSpec.json_schema(slow, "response_format")
    tiny.add_request("slow", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, structured=spec))
    tiny.add_request("plain", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    future = tiny.grammars.submit(spec)
    tokens_while_compiling = 0
    finished = set()
    while tiny.has_unfinished():
        compiling = not future.done()
        for out in tiny.step():
            if out.request_id == "plain" and compiling:
                tokens_while_compiling += sum(len(d.token_ids) for d in out.outputs)
            if out.finished:
                finished.add(out.request_id)
        assert not tiny.pop_failures()
    assert tokens_while_compiling >= 3
    assert finished == {"slow", "plain"}


def test_a_bad_grammar_fails_only_its_own_request(tiny_model_path) -> None:
    engine = AsyncEngine(
        EngineConfig(model_path=str(tiny_model_path), max_num_seqs=16, num_kv_pages=128, dtype="float32")
    )  # batch-invariant: rows are compared across batches

    async def one(request_id: str, params: SamplingParams) -> str | Exception:
        text = ""
        try:
            async for out in engine.generate(PROMPTS[0], params, request_id):
                text += "".join(d.text for d in out.outputs)
        except Exception as exc:
            return exc
        return text

    async def main() -> list:
        good = SamplingParams(temperature=0.0, max_tokens=200, structured=schema_spec("matrix"))
        plain = SamplingParams(temperature=0.0, max_tokens=30)
        bad = [
            ("regex", "a(b", "guided_regex"),
            ("grammar", 'root ::= "a" | ', "ebnf"),
            ("grammar", "root ::= undefined_rule", "structured_outputs.grammar"),
        ]
        tasks = [one("good", good), one("plain", plain)]
        tasks += [
            one(f"bad{i}", SamplingParams(temperature=0.0, structured=StructuredSpec(kind=k, value=v, param=p)))
            for i, (k, v, p) in enumerate(bad)
        ]
        return await asyncio.gather(*tasks)

    try:
        good, plain, *bad = asyncio.run(main())
    finally:
        engine.shutdown()
    assert_valid("matrix", good)
    assert isinstance(plain, str) and plain
    assert [(type(e), e.param) for e in bad] == [
        (InvalidRequest, "guided_regex"),
        (InvalidRequest, "ebnf"),
        (InvalidRequest, "structured_outputs.grammar"),
    ]
    assert "cannot compile" in bad[0].message


def test_compile_failure_inside_the_engine_fails_that_request_alone(tiny) -> None:
    bad = StructuredSpec(kind="regex", value="x{2,1}", param="regex")
    tiny.add_request("ok", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    try:
        tiny.add_request("bad", PROMPTS[1], SamplingParams(temperature=0.0, structured=bad))
    except InvalidRequest as exc:  # the compile was quick enough to fail at once
        failures = [("bad", exc)]
    else:
        failures = []
    outputs = []
    while tiny.has_unfinished():
        outputs += tiny.step()
        failures += tiny.pop_failures()
    assert [(r, type(e), e.param) for r, e in failures] == [("bad", InvalidRequest, "regex")]
    assert outputs[-1].request_id == "ok" and outputs[-1].finished
