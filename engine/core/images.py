"""A request's images on their way in: decoded and preprocessed once (engine/image/), hashed by their pixels, and
matched to the runs of image soft tokens in the prompt (ImageSpan). The model runner encodes a span's image in the
step that prefills it; the span's digest joins the prefix-cache hashes of the pages it touches."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequest, NoImageInput, StartupError
from engine.image.decode import decode_image
from engine.image.gemma import GemmaImageConfig, preprocess
from engine.inputs import ImageData, ImagePrompt
from engine.model.vision.spec import VisionSpec

log = logging.getLogger(__name__)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(eq=False)
class ImageSpan:
    """One image of a prompt: its soft tokens are prompt positions [start, end); pixels [3, size, size]."""

    start: int
    end: int
    pixels: torch.Tensor
    digest: bytes  # of the preprocessed pixels: the same picture hits the prefix cache, another one does not

    @property
    def key(self) -> tuple[int, int, bytes]:
        return self.start, self.end, self.digest


def read_processor_config(model_path: str) -> dict:
    """The image processor's settings the bake kept: preprocessor_config.json, or processor_config.json's
    image_processor (transformers 5 writes one file for the whole processor); {} when neither is there."""
    for name in PROCESSOR_FILES:
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            with open(path) as f:
                raw = json.load(f)
            return raw.get("image_processor", raw) if name == "processor_config.json" else raw
    return {}


class ImageIntake:
    """Turns a request's ImageData into ImageSpans for a model that takes images (Gemma 3's processing)."""

    def __init__(self, vision: VisionSpec | None, model_path: str, tokenizer: object, max_chunk: int) -> None:
        self.vision, self.max_chunk = vision, max_chunk
        self.prompt: ImagePrompt | None = None
        self.refusal = "this model takes no image input"
        if vision is None:
            return
        raw = read_processor_config(model_path)
        size = raw.get("size") or {}
        raw = {**raw, "size": {"height": size.get("height") or vision.image_size,
                               "width": size.get("width") or vision.image_size}}
        self.config = GemmaImageConfig.from_dict(raw)
        if (self.config.height, self.config.width) != (vision.image_size, vision.image_size):
            raise StartupError(f"the image processor resizes to {self.config.width}x{self.config.height}, but the "
                               f"vision tower takes {vision.image_size}x{vision.image_size}", param="model")
        ids = [vision.boi_token_id, vision.image_token_id, vision.eoi_token_id]
        boi, image, eoi = tokenizer.convert_ids_to_tokens(ids)
        if None in (boi, image, eoi):
            # A checkpoint whose tokenizer lacks the image tokens: its text model serves, images are refused.
            missing = ", ".join(str(i) for i, t in zip(ids, (boi, image, eoi), strict=True) if t is None)
            self.refusal = f"this model takes no image input (its tokenizer has no token {missing})"
            log.warning("%s", self.refusal)
            self.vision = None
            return
        # transformers' Gemma3Processor.full_image_sequence
        self.prompt = ImagePrompt(boi, f"\n\n{boi}{image * vision.tokens_per_image}{eoi}\n\n", vision.tokens_per_image)

    def spans(self, prompt: list[int], images: list[ImageData]) -> list[ImageSpan]:
        """The prompt's image spans with their images; InvalidRequest naming the image when they do not match."""
        if self.vision is None:
            if images:
                raise NoImageInput(self.refusal, param=images[0].param)
            return []
        runs = image_runs(prompt, self.vision.image_token_id)
        if len(runs) != len(images):
            raise InvalidRequest(f"the prompt has {len(runs)} image placeholders for {len(images)} images: write "
                                 f"each image as a content part (the template places {self.prompt.placeholder})",
                                 param="messages")
        spans = []
        for (start, end), image in zip(runs, images, strict=True):
            if end - start != self.vision.tokens_per_image:
                raise InvalidRequest(f"{image.param}: its placeholder has {end - start} soft tokens, not the "
                                     f"{self.vision.tokens_per_image} an image takes (a truncated prompt?)",
                                     param=image.param)
            if end - start > self.max_chunk:
                raise InvalidRequest(f"an image takes {end - start} tokens, more than max_num_batched_tokens "
                                     f"({self.max_chunk}) lets one step prefill", param=image.param)
            pixels = self.pixels(image)
            digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16).digest()
            spans.append(ImageSpan(start, end, pixels, digest))
        return spans

    def pixels(self, image: ImageData) -> torch.Tensor:
        if self.config.do_pan_and_scan:
            raise InvalidRequest("this model's processor asks for pan and scan, which the engine does not run yet",
                                 param=image.param)
        return torch.from_numpy(preprocess(decode_image(image.data, image.param), self.config)[0])


def image_runs(prompt: list[int], token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `token_id` in the prompt."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(prompt):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(prompt)))
    return runs
