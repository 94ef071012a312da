"""Image parts of chat messages: each `image_url` part ({"url": data: or http(s) URL, "detail"}) becomes the
{"type": "image"} part chat templates render (as transformers' processors feed them), and its file is read: a
data: URL decoded, an http(s) URL fetched with httpx under IMAGE_FETCH_MAX_MB, IMAGE_FETCH_TIMEOUT_SECONDS and
MAX_IMAGES_PER_REQUEST, never from a loopback, private or link-local address unless IMAGE_FETCH_ALLOW_PRIVATE is
set (each redirect is checked again). The engine decodes the bytes (engine.inputs.ImageData), naming the part."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from engine.inputs import ImageData
from worker.openai.errors import BadRequest
from worker.settings import Settings

DETAILS = ("auto", "low", "high")
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: where its file is and the part it came from (for errors)."""

    url: str
    param: str


def take_images(messages: list[Any], takes_images: bool, settings: Settings) -> tuple[list[dict], list[ImageRef]]:
    """The messages as plain dicts with every image part made {"type": "image"}, and the images in prompt order;
    BadRequest naming the part for a bad one, for too many, or for any on a model that takes none."""
    out: list[dict] = []
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    # `where`: the part's place in the request as another API door wrote it (Responses, Anthropic)
                    where = part.get("where")
                    param = where or f"messages.[{i}].content.[{j}].image_url"
                    refs.append(_image_ref(part.get("image_url"), param, takes_images, where or param + ".url"))
                    part = {"type": "image"}
                parts.append(part)
            item["content"] = parts
        out.append(item)
    if len(refs) > settings.max_images_per_request:
        raise BadRequest(
            f"the request has {len(refs)} images, more than the {settings.max_images_per_request} one "
            "request may have (MAX_IMAGES_PER_REQUEST)",
            param=refs[settings.max_images_per_request].param,
        )
    return out, refs


def _image_ref(value: Any, param: str, takes_images: bool, url_param: str) -> ImageRef:
    # The part's shape first, as OpenAI checks it (a bare URL string is refused there too), then what the model takes.
    if isinstance(value, str):
        raise BadRequest(
            f"Invalid type for '{param}': expected an object with a `url` string, but got a string instead.",
            param=param,
        )
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise BadRequest("image_url must be an object with a `url` string", param=param)
    if not takes_images:
        raise BadRequest("this model takes no image input", param=param)
    detail = value.get("detail")
    if detail is not None and detail not in DETAILS:
        raise BadRequest(f"detail {detail!r} is not one of {', '.join(DETAILS)}", param=param + ".detail")
    url = value["url"]
    if not url.startswith("data:") and urlsplit(url).scheme not in ("http", "https"):
        raise BadRequest("an image url must be a data: URL or an http(s) URL", param=url_param)
    return ImageRef(url, url_param)


async def read_images(refs: list[ImageRef], settings: Settings) -> list[ImageData]:
    """Each image's file: data: URLs decoded, http(s) URLs fetched together (one client for the request)."""
    if not refs:
        return []
    fetched = [r for r in refs if not r.url.startswith("data:")]
    files: dict[str, bytes] = {}
    if fetched:
        import httpx

        async with httpx.AsyncClient(follow_redirects=False, timeout=settings.image_fetch_timeout_s) as client:
            bodies = await asyncio.gather(*(fetch_image(client, r, settings) for r in fetched))
        files = {r.param: body for r, body in zip(fetched, bodies, strict=True)}
    return [ImageData(files[r.param] if r.param in files else data_url_bytes(r), r.param) for r in refs]


def data_url_bytes(ref: ImageRef) -> bytes:
    """data:[<media type>];base64,<data> -> the bytes."""
    head, comma, body = ref.url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise BadRequest("an image data: URL must be base64 (data:image/png;base64,...)", param=ref.param)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("the image data: URL is not valid base64", param=ref.param) from None


async def fetch_image(client: Any, ref: ImageRef, settings: Settings) -> bytes:
    """The file at an http(s) URL, within the size and time limits, redirects followed (and checked) by hand."""
    import httpx

    limit = int(settings.image_fetch_max_mb * 2**20)
    url = ref.url
    try:
        async with asyncio.timeout(settings.image_fetch_timeout_s):
            for _ in range(MAX_REDIRECTS + 1):
                await _check_host(url, ref, settings)
                async with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code >= 400:
                        raise BadRequest(f"fetching the image gave HTTP {response.status_code}", param=ref.param)
                    if int(response.headers.get("content-length") or 0) > limit:
                        raise _too_big(ref, settings)
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise _too_big(ref, settings)
                    return bytes(body)
            raise BadRequest(f"fetching the image was redirected more than {MAX_REDIRECTS} times", param=ref.param)
    except TimeoutError:
        raise BadRequest(
            f"fetching the image took longer than {settings.image_fetch_timeout_s:g} s (IMAGE_FETCH_TIMEOUT_SECONDS)",
            param=ref.param,
        ) from None
    except httpx.HTTPError as exc:
        raise BadRequest(
            f"the image could not be fetched ({type(exc).__name__}: {exc}); a worker without internet "
            "access takes images as data: URLs only",
            param=ref.param,
        ) from None


def _too_big(ref: ImageRef, settings: Settings) -> BadRequest:
    return BadRequest(
        f"the image is larger than {settings.image_fetch_max_mb:g} MiB (IMAGE_FETCH_MAX_MB)", param=ref.param
    )


async def _check_host(url: str, ref: ImageRef, settings: Settings) -> None:
    """Refuses a URL whose host resolves to a loopback, private, link-local or reserved address (the worker's own
    network) unless IMAGE_FETCH_ALLOW_PRIVATE is set. NOTE: the address is resolved here and again by httpx, so a
    host whose DNS answer changes in between is not caught; the setting is the switch for trusted networks only."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest("an image url must be an http(s) URL with a host", param=ref.param)
    if settings.image_fetch_allow_private:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, parts.port or 443, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise BadRequest(
            f"the image's host {parts.hostname!r} does not resolve ({exc}); a worker without internet "
            "access takes images as data: URLs only",
            param=ref.param,
        ) from None
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not address.is_global or address.is_multicast:
            raise BadRequest(
                f"the image's host {parts.hostname!r} is a private or loopback address, which the "
                "worker does not fetch from (IMAGE_FETCH_ALLOW_PRIVATE)",
                param=ref.param,
            )
