"""Image URLs fetched by worker/openai/images.py from a real loopback HTTP server: refused by default (the worker's
own network), fetched with IMAGE_FETCH_ALLOW_PRIVATE (a redirect followed), and the size and time limits, each a
BadRequest naming the part; data: URLs decoded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from worker.openai.errors import BadRequest
from worker.openai.images import ImageRef, read_images, take_images
from worker.settings import load_settings

BODY = b"\x89PNG" + bytes(range(256)) * 8  # 2 KiB (the engine, not this module, reads it as an image)
PARAM = "messages.[0].content.[0].image_url.url"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, threading.Event]]:
    release = threading.Event()  # the slow route answers once the test lets it

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/image")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path == "/slow":
                release.wait()
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", release
    release.set()
    httpd.shutdown()


def read(url: str, **env: str) -> bytes:
    return asyncio.run(read_images([ImageRef(url, PARAM)], load_settings(env)))[0].data


def test_a_loopback_url_is_refused_by_default(server) -> None:
    with pytest.raises(BadRequest, match="private or loopback") as info:
        read(server[0] + "/image")
    assert info.value.param == PARAM


def test_allowed_it_is_fetched_and_a_redirect_followed(server) -> None:
    assert read(server[0] + "/image", IMAGE_FETCH_ALLOW_PRIVATE="1") == BODY
    assert read(server[0] + "/moved", IMAGE_FETCH_ALLOW_PRIVATE="1") == BODY


def test_the_size_and_time_limits(server) -> None:
    with pytest.raises(BadRequest, match="larger than 0.001 MiB"):
        read(server[0] + "/image", IMAGE_FETCH_ALLOW_PRIVATE="1", IMAGE_FETCH_MAX_MB="0.001")
    with pytest.raises(BadRequest, match="longer than 0.2 s") as info:
        read(server[0] + "/slow", IMAGE_FETCH_ALLOW_PRIVATE="1", IMAGE_FETCH_TIMEOUT_SECONDS="0.2")
    assert info.value.param == PARAM


def test_data_urls_and_the_parts_the_template_sees() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}},
            ],
        }
    ]
    shown, refs = take_images(messages, True, load_settings({}))
    assert shown[0]["content"] == [{"type": "text", "text": "hi"}, {"type": "image"}]
    assert refs == [ImageRef("data:image/png;base64,AAEC", "messages.[0].content.[1].image_url.url")]
    assert asyncio.run(read_images(refs, load_settings({})))[0].data == b"\x00\x01\x02"
    with pytest.raises(BadRequest, match="must be base64"):
        asyncio.run(read_images([ImageRef("data:image/png,raw", PARAM)], load_settings({})))
