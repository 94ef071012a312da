"""Image bytes -> an RGB Pillow image, as a user's photo is meant to be seen: the EXIF orientation applied, the
first frame of an animation, transparency (an alpha band, or a palette's transparent colour) composited onto white
as transformers' convert_to_rgb does. Anything Pillow cannot read is an InvalidRequest naming the image."""

from __future__ import annotations

import io
import warnings

from engine.errors import InvalidRequest

# Pillow's own guard against decompression bombs, as an error instead of a warning: pixels in one image at most.
MAX_PIXELS = 64 * 2**20


def decode_image(data: bytes, param: str = "image") -> "PIL.Image.Image":  # noqa: F821
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_PIXELS:
                raise InvalidRequest(f"{param}: {image.width}x{image.height} pixels is more than the "
                                     f"{MAX_PIXELS} one image may have", param=param)
            image.seek(0)  # an animation's first frame
            image = ImageOps.exif_transpose(image)
            image.load()
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{param} is not an image Pillow can read ({type(exc).__name__}: {exc})",
                             param=param) from None
    return to_rgb(image)


def to_rgb(image: "PIL.Image.Image") -> "PIL.Image.Image":  # noqa: F821
    """RGB, with any transparency composited onto a white background."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
