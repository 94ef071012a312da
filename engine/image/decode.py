"""Image bytes -> an RGB Pillow image, as a user's photo is meant to be seen: the EXIF orientation applied, the
first frame of an animation, transparency (an alpha band, or a palette's transparent colour) composited onto white
as transformers' convert_to_rgb does. Anything Pillow cannot read is an InvalidRequest naming the image, in words
about the input (never a repr of ours, never Pillow's own decompression-bomb text)."""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

from engine.errors import InvalidRequest

if TYPE_CHECKING:
    import PIL.Image

# Pixels in one image at most: checked on the size the file's header declares, before anything is decoded.
MAX_PIXELS = 64 * 2**20
# A repr of an object of ours in an exception's text (`<_io.BytesIO object at 0x7f...>`): nothing a client can use.
_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")


def decode_image(data: bytes, param: str = "image") -> PIL.Image.Image:
    from PIL import Image, ImageOps, UnidentifiedImageError

    # NOTE: our size check below is the one check. Pillow's own (a warning past 89 M pixels, an error past twice
    # that) would run inside Image.open, before the size can be read, and answer in its words; ours is lower.
    Image.MAX_IMAGE_PIXELS = None
    try:
        image: PIL.Image.Image = Image.open(io.BytesIO(data))  # lazy: the header only
    except UnidentifiedImageError:
        raise InvalidRequest(
            f"{param} is not an image in a format this worker reads (PNG, JPEG, GIF, WebP, BMP, TIFF, ...)", param=param
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise _unreadable(exc, param) from None
    if image.width * image.height > MAX_PIXELS:
        raise InvalidRequest(
            f"{param}: {image.width}x{image.height} pixels is more than the {MAX_PIXELS} one image may have",
            param=param,
        )
    try:
        image.seek(0)  # an animation's first frame
        image = ImageOps.exif_transpose(image)
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise _unreadable(exc, param) from None
    return to_rgb(image)


def _unreadable(exc: BaseException, param: str) -> InvalidRequest:
    """A file Pillow recognised but could not decode: what it found wrong, in its words less our objects' reprs."""
    reason = _OBJECT_REPR.sub("", str(exc)).strip() or type(exc).__name__
    return InvalidRequest(f"{param} is not an image Pillow can read ({reason})", param=param)


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB, with any transparency composited onto a white background."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
