"""A tiny Gemma 3 image-text model baked by the builder (vision_bake.py) answers chat requests with image parts
through the local endpoint and the official openai client: data: URLs and a loopback http URL (the fetch allowed by
IMAGE_FETCH_ALLOW_PRIVATE), whole and streamed alike, usage counting the image's soft tokens, the image moving the
answer's logprobs, the same image in a later turn served from the prefix cache; a native job's `messages` take the
same parts. Bad image input is a 400 naming the part, and the worker serves the next request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
from local_worker import LocalWorker, start_worker, stop_worker
from vision_bake import TOKENS, bake_vision_model, check_image_moves_the_answer, data_url, png

RED, BLUE = png(80, 40, (200, 30, 30)), png(30, 70, (20, 40, 220), "JPEG")
NAME = "tiny-gemma3-vision"


@pytest.fixture(scope="module")
def vision_worker(baked_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorker]:
    root = tmp_path_factory.mktemp("vision")
    out = bake_vision_model(baked_model_path, root)
    w = start_worker(
        out, root / "worker.log", MAX_MODEL_LEN="512", MAX_IMAGES_PER_REQUEST="2", IMAGE_FETCH_ALLOW_PRIVATE="1"
    )
    yield w
    stop_worker(w)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A loopback HTTP server with /red.png."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = RED if self.path == "/red.png" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def ask(url: str, text: str = "What is in the picture?", **image: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url, **image}}, {"type": "text", "text": text}],
        }
    ]


def test_an_image_part_whole_and_streamed(vision_worker: LocalWorker) -> None:
    sdk = vision_worker.client()
    plain = sdk.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is in the picture?"}], max_tokens=8, temperature=0
    )
    whole = sdk.chat.completions.create(
        model=NAME, messages=ask(data_url(RED), detail="high"), max_tokens=8, temperature=0
    )
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content
    # The image's span: "\n\n", <start_of_image>, its soft tokens, <end_of_image>, "\n\n".
    assert whole.usage.prompt_tokens >= plain.usage.prompt_tokens + TOKENS + 2
    stream = sdk.chat.completions.create(
        model=NAME,
        messages=ask(data_url(RED), detail="high"),
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_tokenize_counts_an_image_as_a_chat_completion_does(vision_worker: LocalWorker) -> None:
    messages = ask(data_url(RED), detail="high")
    whole = vision_worker.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    with vision_worker.http() as http:
        counted = http.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert counted["count"] == len(counted["tokens"]) == len(counted["token_strs"]) == whole.usage.prompt_tokens


def test_the_image_moves_the_answer_and_a_later_turn_hits_the_cache(vision_worker: LocalWorker) -> None:
    check_image_moves_the_answer(vision_worker.client(), NAME, ask, data_url(RED), data_url(BLUE, "image/jpeg"), TOKENS)


def test_an_http_image_url_is_fetched(vision_worker: LocalWorker, image_server: str) -> None:
    sdk = vision_worker.client()
    fetched = sdk.chat.completions.create(
        model=NAME, messages=ask(image_server + "/red.png"), max_tokens=6, temperature=0
    )
    inline = sdk.chat.completions.create(model=NAME, messages=ask(data_url(RED)), max_tokens=6, temperature=0)
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=NAME, messages=ask(image_server + "/missing.png"), max_tokens=2)
    assert "HTTP 404" in str(info.value)


def test_a_native_job_takes_image_parts(vision_worker: LocalWorker) -> None:
    with vision_worker.http() as http:
        body = {"input": {"messages": ask(data_url(RED)), "sampling_params": {"max_tokens": 6, "temperature": 0}}}
        out = http.post("/v2/test-endpoint/runsync", json=body).json()
    chat = vision_worker.client().chat.completions.create(
        model=NAME, messages=ask(data_url(RED)), max_tokens=6, temperature=0
    )
    assert out["status"] == "COMPLETED", out
    text = "".join(out["output"][0]["choices"][0]["tokens"])
    assert text == chat.choices[0].message.content


BAD = [
    (ask(data_url(b"this is not an image")), "messages.[0].content.[0].image_url.url", "not an image"),
    (ask(data_url(RED[: len(RED) // 2])), "messages.[0].content.[0].image_url.url", "not an image"),
    (ask("data:image/png;base64,@@@"), "messages.[0].content.[0].image_url.url", "not valid base64"),
    (ask(data_url(RED), detail="ultra"), "messages.[0].content.[0].image_url.detail", "detail 'ultra'"),
    (ask("ftp://example.com/a.png"), "messages.[0].content.[0].image_url.url", "data: URL or an http(s) URL"),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}] * 3}],
        "messages.[0].content.[2].image_url.url",
        "more than the 2",
    ),
]


@pytest.mark.parametrize(
    ("messages", "param", "message"), BAD, ids=["not-image", "truncated", "base64", "detail", "scheme", "too-many"]
)
def test_bad_image_input_is_a_400_naming_the_part(vision_worker: LocalWorker, messages, param, message) -> None:
    sdk = vision_worker.client()
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert info.value.status_code == 400 and message in info.value.message
    assert info.value.body["param"] == param
    assert sdk.chat.completions.create(model=NAME, messages=ask(data_url(RED)), max_tokens=2).choices


def test_a_text_only_model_takes_no_image(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=ask(data_url(RED)), max_tokens=2)
    assert "this model takes no image input" in info.value.message
    assert info.value.body["param"] == "messages.[0].content.[0].image_url"


def test_an_image_url_given_as_a_bare_string_is_refused_naming_it(client: openai.OpenAI, model_name: str) -> None:
    # OpenAI requires {"url": ...}; the part's shape is checked before what the model takes, as OpenAI checks it.
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": data_url(RED)}],
        }
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    assert info.value.body["param"] == "messages.[0].content.[1].image_url"
    assert "expected an object" in info.value.message and "got a string" in info.value.message


def test_the_responses_api_takes_input_image(vision_worker: LocalWorker, image_server: str) -> None:
    sdk = vision_worker.client()
    chat = sdk.chat.completions.create(model=NAME, messages=ask(data_url(RED)), max_tokens=6, temperature=0)
    content = [
        {"type": "input_image", "image_url": data_url(RED), "detail": "auto"},
        {"type": "input_text", "text": "What is in the picture?"},
    ]
    whole = sdk.responses.create(
        model=NAME, input=[{"role": "user", "content": content}], max_output_tokens=6, temperature=0
    )
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    events = list(
        sdk.responses.create(
            model=NAME, input=[{"role": "user", "content": content}], max_output_tokens=6, temperature=0, stream=True
        )
    )
    assert events[-1].response.output_text == whole.output_text
    by_url = [{"type": "input_image", "image_url": image_server + "/red.png"}, content[1]]
    fetched = sdk.responses.create(
        model=NAME, input=[{"role": "user", "content": by_url}], max_output_tokens=6, temperature=0
    )
    assert fetched.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(
            model=NAME,
            input=[{"role": "user", "content": [content[1], {"type": "input_image", "image_url": data_url(b"nope")}]}],
            max_output_tokens=2,
        )
    assert info.value.body["param"] == "input[0].content[1]"


def test_anthropic_messages_take_image_blocks(vision_worker: LocalWorker, image_server: str) -> None:
    import base64

    import anthropic
    from local_worker import ENDPOINT

    claude = anthropic.Anthropic(base_url=vision_worker.url(f"{ENDPOINT}/openai"), api_key="unused", max_retries=0)
    chat = vision_worker.client().chat.completions.create(
        model=NAME, messages=ask(data_url(RED)), max_tokens=6, temperature=0
    )
    sources = [
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()},
        {"type": "url", "url": image_server + "/red.png"},
    ]

    def turn(source: dict) -> list[dict]:
        return [
            {
                "role": "user",
                "content": [{"type": "image", "source": source}, {"type": "text", "text": "What is in the picture?"}],
            }
        ]

    greedy = {"max_tokens": 6, "extra_body": {"temperature": 0}}  # this SDK has no temperature argument
    for source in sources:
        message = claude.messages.create(model=NAME, messages=turn(source), **greedy)
        assert message.content[0].text == chat.choices[0].message.content
        # Anthropic's input_tokens leave out the prompt tokens read from the cache
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(model=NAME, messages=turn(sources[0]), **greedy) as streamed:
        assert "".join(streamed.text_stream) == chat.choices[0].message.content
    assert claude.messages.count_tokens(model=NAME, messages=turn(sources[0])).input_tokens == chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        bad = {"type": "base64", "media_type": "image/png", "data": "bm9wZQ=="}
        claude.messages.create(
            model=NAME, max_tokens=2, messages=[{"role": "user", "content": [{"type": "image", "source": bad}]}]
        )
    assert "messages.0.content.0" in str(info.value.body)
