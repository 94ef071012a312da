"""Property-based fuzzing of every door: HTTP bodies of each OpenAI route, RunPod jobs of both shapes, and
native `sampling_params`, built by mutating a valid request with hostile values (wrong types, huge and
negative numbers, NaN and infinities, deep nesting, lone surrogates, out-of-vocabulary token ids).

Properties: a client's mistake is never a 5xx nor an internal-error message; every refusal is an OpenAI
error object whose `param` names a field the client sent; the worker answers the next valid request; and
once every request is done the KV pool holds no page. The CI budget is small (FUZZ_EXAMPLES, default 40
per door); the slow-marked `test_long_fuzz_run` reruns this module with 2,500 per door (over 10,000 inputs):
`pytest -m slow tests/worker/test_fuzz.py -s`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_schema import validate
from waiting import wait_until

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)

# Small integers only: a valid mid-sized max_tokens would make one example generate for a minute.
INTS = st.sampled_from([-(2**63) - 1, -(2**31), -1, 0, 1, 2, 3, 2**31, 2**63, 2**64, 10**30])
FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e308, -1e-300, 0.5, 1.5, 3.0, -2.5])
STRINGS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["\ud800", "\udfff x", "\x00", "", " ", "a" * 3000, "<|im_end|>", "{{ raise_exception('x') }}"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, STRINGS)
HOSTILE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(STRINGS, inner, max_size=4)),
    max_leaves=12,
)
# Deep nesting: a list inside a list 500 levels down, which recursive parsers and validators choke on.
DEEP = st.integers(100, 500).map(lambda depth: json.loads("[" * depth + "]" * depth))
VALUES = st.one_of(HOSTILE, DEEP, st.lists(st.integers(-5, 2**40), max_size=6))
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"}
LENGTH_VALUES = st.one_of(st.sampled_from([-1, 0, 1, 2, 10**9, 2**64, "3", 3.5, True, [], {}, float("nan")]))

CHAT_FIELDS = [
    "messages",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
    "response_format",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "use_beam_search",
    "length_penalty",
    "ignore_eos",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "echo",
    "model",
    "user",
]
COMPLETION_FIELDS = [
    "prompt",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stream",
    "logprobs",
    "echo",
    "max_tokens",
    "suffix",
    "logit_bias",
    "seed",
    "prompt_logprobs",
    "model",
    "use_beam_search",
    "min_tokens",
    "truncate_prompt_tokens",
    "add_special_tokens",
]
RESPONSE_FIELDS = [
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_logprobs",
    "include",
    "text",
    "tools",
    "tool_choice",
    "reasoning",
    "metadata",
    "store",
    "previous_response_id",
    "truncation",
    "stream",
    "model",
    "n",
    "background",
    "top_k",
    "stop",
]
NATIVE_FIELDS = [
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "seed",
    "use_beam_search",
    "allowed_token_ids",
    "bad_words",
    "ignore_eos",
    "repetition_penalty",
    "truncate_prompt_tokens",
]


def mutated(base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with one to three of `fields` set to hostile values (or dropped), sometimes an extra key."""

    def one(field: str) -> st.SearchStrategy[tuple[str, Any]]:
        if field in LENGTH_FIELDS:  # never dropped: without a limit one example could generate for minutes
            return st.tuples(st.just(field), LENGTH_VALUES)
        return st.tuples(st.just(field), st.one_of(VALUES, st.just(DROP)))

    changes = st.lists(st.sampled_from(fields).flatmap(one), min_size=1, max_size=3)
    extra = st.dictionaries(STRINGS, HOSTILE, max_size=1)

    def apply(pair: tuple[list[tuple[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        body = dict(base)
        for field, value in pair[0]:
            if value is DROP:
                body.pop(field, None)
            else:
                body[field] = value
        body.update({k: v for k, v in pair[1].items() if k not in base and k not in fields})
        return body

    return st.tuples(changes, extra).map(apply)


DROP = object()


def check_answer(reply: Any, sent: dict[str, Any], base: dict[str, Any]) -> None:
    """No 5xx; an error is OpenAI's object naming a field that was sent (or a required one the base has)."""
    assert reply.status_code < 500, f"{reply.status_code} for {_short(sent)}: {reply.text[:300]}"
    if reply.status_code >= 400:
        error = validate(reply.json())["error"]
        assert "Internal" not in error["message"], error
        _check_param(error, sent, base)


def _check_param(error: dict[str, Any], sent: dict[str, Any], base: dict[str, Any]) -> None:
    param = error.get("param")
    if error.get("code") in ("model_not_found", "unknown_url") or param is None:
        return
    names = {_escaped(str(k)) for k in (*sent, *base)}  # a key holding a lone surrogate is named escaped
    assert any(param == n or param.startswith((f"{n}.", f"{n}[")) for n in names), (
        f"param {param!r} names nothing that was sent: {_short(sent)}"
    )


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


def _short(obj: Any) -> str:
    return json.dumps(obj, default=str)[:400]


def _post(http: Any, path: str, body: Any) -> Any:
    content = json.dumps(body, allow_nan=True).encode()  # ASCII: lone surrogates travel as \ud800 escapes
    stream = isinstance(body, dict) and body.get("stream") is True
    if not stream:
        return http.post(path, content=content, headers={"Content-Type": "application/json"})
    with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as reply:
        reply.read()
        return reply


@pytest.fixture(scope="module")
def bases(model_name: str) -> dict[str, dict[str, Any]]:
    return {
        "chat": {
            "model": model_name,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "temperature": 0,
        },
        "completions": {"model": model_name, "prompt": "The sea is", "max_tokens": 2},
        "responses": {"model": model_name, "input": "Hi", "max_output_tokens": 2},
        "native": {"prompt": "The sea is", "sampling_params": {"max_tokens": 2, "temperature": 0}},
    }


@FUZZ
@given(data=st.data())
def test_fuzzed_chat_bodies(http, bases, data) -> None:
    body = data.draw(mutated(bases["chat"], CHAT_FIELDS))
    check_answer(_post(http, "/openai/v1/chat/completions", body), body, bases["chat"])


@FUZZ
@given(data=st.data())
def test_fuzzed_completion_bodies(http, bases, data) -> None:
    body = data.draw(mutated(bases["completions"], COMPLETION_FIELDS))
    check_answer(_post(http, "/openai/v1/completions", body), body, bases["completions"])


@FUZZ
@given(data=st.data())
def test_fuzzed_response_bodies(http, bases, data) -> None:
    body = data.draw(mutated(bases["responses"], RESPONSE_FIELDS))
    check_answer(_post(http, "/openai/v1/responses", body), body, bases["responses"])


@FUZZ
@given(data=st.data())
def test_fuzzed_native_jobs_and_job_envelopes(http, bases, data) -> None:
    kind = data.draw(st.sampled_from(["native", "openai", "envelope"]))
    if kind == "native":
        params = data.draw(mutated(bases["native"]["sampling_params"], NATIVE_FIELDS))
        job_input = data.draw(
            mutated(
                {**bases["native"], "sampling_params": params},
                ["prompt", "messages", "stream", "apply_chat_template", "max_batch_size"],
            )
        )
        sent = {**job_input, **(params if isinstance(params, dict) else {})}
        base = {**bases["native"], **bases["native"]["sampling_params"]}
    elif kind == "openai":
        route = data.draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]))
        base, fields = {
            "/v1/chat/completions": (bases["chat"], CHAT_FIELDS),
            "/v1/completions": (bases["completions"], COMPLETION_FIELDS),
            "/v1/responses": (bases["responses"], RESPONSE_FIELDS),
        }[route]
        body = data.draw(mutated(base, fields))
        job_input = {"openai_route": route, "openai_input": body}
        sent = {**body, **job_input}
        base = {**base, **job_input}
    else:
        job_input = data.draw(
            mutated(
                {"openai_route": "/v1/models", "openai_input": {}}, ["openai_route", "openai_input", "openai_method"]
            )
        )
        body = job_input.get("openai_input")
        sent = {**job_input, **(body if isinstance(body, dict) else {})}  # an OpenAI body's fields are named bare
        base = {"openai_route": None, "prompt": None}  # without a route, a job is native and needs a prompt
    reply = _post(http, "/v2/fuzz/runsync", {"input": job_input})
    assert reply.status_code < 500, reply.text[:300]
    result = reply.json()
    if result["status"] == "FAILED":
        error = result["error"]
        assert isinstance(error, dict) and "Internal" not in error["message"], error
        _check_param(error, sent, base)
    else:
        assert result["status"] == "COMPLETED", result


@FUZZ
@given(
    raw=st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"\xff\xfe{", b'{"model": "\xc3\x28"}', b"[]", b"null", b'"x"', b"{" * 10_000]),
    )
)
def test_raw_bytes_bodies(http, raw) -> None:
    for path in ("/openai/v1/chat/completions", "/openai/v1/completions", "/openai/v1/responses", "/v2/f/run"):
        reply = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, (path, raw[:40], reply.text[:200])
        validate(reply.json())


def test_after_the_fuzzing_the_worker_serves_and_holds_no_page(client, http, model_name) -> None:
    """Runs after the fuzz tests in this module (pytest keeps file order)."""
    answer = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert answer.choices[0].message.content
    wait_until(
        lambda: (e := http.get("/health").json()["engine"])["kv_pages_free"] == e["kv_pages"],
        "every page free after the fuzzing",
    )


@pytest.mark.slow
def test_long_fuzz_run() -> None:
    """The same properties with 2,500 examples per door, in a fresh worker; prints the summary and the time."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-m", "not slow", "-W", "ignore", "-p", "no:cacheprovider"],
        env={**os.environ, "FUZZ_EXAMPLES": "2500"},
        capture_output=True,
        text=True,
    )
    print(result.stdout[-2000:], f"\nlong fuzz run: {time.monotonic() - started:.0f} s")
    assert result.returncode == 0, result.stdout[-5000:]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/openai/v1/responses", {"input": "\ud800"}, "input"),
        (
            "/openai/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\udfffb"}]},
            "messages.[0].content",
        ),
        ("/openai/v1/completions", {"prompt": ["ok", "\ud800"]}, "prompt.[1]"),
        (
            "/openai/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stop": {"\ud800": 1}},
            "stop.\\ud800",
        ),  # a key holding the surrogate is named with it escaped
    ],
)
def test_unpaired_surrogates_are_a_400_naming_the_field(http, model_name, path, body, param) -> None:
    """Found by the long run: a lone surrogate (valid JSON, invalid Unicode) reached the tokenizer as a 500."""
    reply = _post(http, path, {"model": model_name, "max_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    error = validate(reply.json())["error"]
    assert error["param"] == param
    job = _post(http, "/v2/e/runsync", {"input": {"prompt": "\ud800", "sampling_params": {"max_tokens": 2}}}).json()
    assert job["status"] == "FAILED" and job["error"]["param"] == "prompt"


def test_a_native_job_with_empty_messages_names_messages(http) -> None:
    """Found by the long run: `messages: []` next to a prompt reached the chat template and blamed it."""
    job = http.post("/v2/e/runsync", json={"input": {"prompt": "Hi", "messages": []}}).json()
    assert job["status"] == "FAILED" and job["error"]["param"] == "messages"
