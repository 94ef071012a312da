"""Image bytes as users send them (engine/image/decode.py): JPEG with an EXIF rotation, palette PNG with a
transparent colour, RGBA PNG, grey, an animated GIF, WebP; bytes that are no image, and a decompression bomb, are
InvalidRequest naming the parameter."""

from __future__ import annotations

import io

import numpy as np
import pytest

from engine.errors import InvalidRequest
from engine.image import decode
from engine.image.decode import decode_image

PIL = pytest.importorskip("PIL.Image")


def encoded(image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def test_a_jpeg_turns_upright_by_its_exif_orientation():
    image = PIL.new("RGB", (40, 20), (200, 10, 10))
    exif = PIL.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees clockwise to view
    got = decode_image(encoded(image, "JPEG", exif=exif))
    assert got.mode == "RGB" and got.size == (20, 40)


def test_transparency_is_composited_onto_white():
    rgba = PIL.new("RGBA", (8, 8), (0, 0, 255, 0))  # fully transparent blue
    assert np.asarray(decode_image(encoded(rgba, "PNG"))).tolist() == [[[255, 255, 255]] * 8] * 8
    palette = PIL.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.info["transparency"] = 1  # the red entry is transparent
    assert np.asarray(decode_image(encoded(palette, "PNG", transparency=1)))[0, 0].tolist() == [255, 255, 255]
    grey = decode_image(encoded(PIL.new("L", (3, 3), 128), "PNG"))
    assert grey.mode == "RGB" and np.asarray(grey)[0, 0].tolist() == [128, 128, 128]


def test_an_animation_gives_its_first_frame():
    frames = [PIL.new("RGB", (6, 6), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert np.asarray(decode_image(data))[0, 0].tolist() == [255, 0, 0]
    webp = decode_image(encoded(PIL.new("RGB", (5, 7), (1, 2, 3)), "WEBP", lossless=True))
    assert webp.size == (5, 7) and np.asarray(webp)[0, 0].tolist() == [1, 2, 3]


def test_what_is_no_image_is_a_clear_error(monkeypatch):
    with pytest.raises(InvalidRequest, match="messages.0.content.1.*not an image") as caught:
        decode_image(b"GIF89a but not really", param="messages.0.content.1")
    assert caught.value.param == "messages.0.content.1"
    monkeypatch.setattr(decode, "MAX_PIXELS", 100)
    with pytest.raises(InvalidRequest, match="11x10 pixels is more than the 100"):
        decode_image(encoded(PIL.new("RGB", (11, 10)), "PNG"))


def declared(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header declares `width` x `height` (decoding it would fail; opening it reads the header)."""
    import struct
    import zlib

    data = bytearray(encoded(PIL.new("RGB", (1, 1)), "PNG"))
    ihdr = 8 + 8  # the signature, then the IHDR chunk's length and type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13])))
    return bytes(data)


@pytest.mark.parametrize("side", [9000, 13000, 20000])
def test_an_oversized_image_gets_one_message_whatever_its_size(side):
    # Pillow's own guard warns past 89 M pixels (13000^2) and fails past twice that (20000^2), in its own words.
    with pytest.raises(InvalidRequest) as caught:
        decode_image(declared(side, side), param="messages.0.content.1")
    message = caught.value.message
    assert f"{side}x{side} pixels is more than the {decode.MAX_PIXELS} one image may have" in message, message
    assert "ecompression" not in message and "Pillow" not in message and caught.value.param == "messages.0.content.1"


@pytest.mark.parametrize("data", [b"this is not an image", b"GIF89a but not really", b""])
def test_an_error_says_what_is_wrong_with_the_input_never_a_repr_of_ours(data):
    with pytest.raises(InvalidRequest, match="not an image") as caught:
        decode_image(data, param="image 0")
    assert " at 0x" not in caught.value.message and "<" not in caught.value.message, caught.value.message
