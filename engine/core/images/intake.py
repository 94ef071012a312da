"""A request's images on their way in: decoded and preprocessed once (engine/image/), hashed by their pixels, and
matched to the runs of image soft tokens in the prompt (ImageSpan). The model runner encodes a span's image in the
step that prefills it; the span's digest joins the prefix-cache hashes of the pages it touches.

A fixed-square tower (Gemma 3) takes the same number of soft tokens per image, which the worker writes in full; with
pan and scan, expand() adds a span per crop of a wide or tall image (pan_and_scan.py), so the rest of the engine sees
each crop as one more image. A patch-grid tower (Qwen-VL) takes as many as the image's merged patches, a pooled-patch
tower (Gemma 4) as many as its pooled patches: the prompt may hold one placeholder token per image, which expand()
widens to the image's count (transformers' Qwen3VLProcessor and Gemma4Processor do this), so usage and max_model_len
count the image's tokens. Pixtral's (Mistral 3) widens it to rows of image tokens with a break token after each
(broken_rows.py): the span covers them all, and only its image tokens take the tower's features."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import torch

from engine.core.images.broken_rows import BrokenRowsPrompt
from engine.core.images.pan_and_scan import PanAndScanPrompt
from engine.errors import InvalidRequest, NoImageInput, StartupError
from engine.image import gemma, gemma4, pixtral, qwen_vl
from engine.image.decode import decode_image
from engine.inputs import ImageData, ImagePrompt
from engine.model.vision.spec import BrokenRows, VisionSpec

log = logging.getLogger(__name__)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(eq=False, kw_only=True)
class ImageSpan:
    """One image of a prompt: its soft tokens are prompt positions [start, end); `pixels` what its tower takes
    ([3, size, size], or Qwen-VL's patches with their `grid` (t, h, w), or Gemma 4's with theirs (rows, columns))."""

    start: int
    end: int
    pixels: torch.Tensor
    digest: bytes  # of the preprocessed pixels: the same picture hits the prefix cache, another one does not
    grid: tuple[int, ...] | None = None
    rope_grid: tuple[int, int] | None = None  # its tokens' rows and columns (3-D positions); None: 1-D positions
    # Pixtral's: rows of this many feature tokens, each followed by a token that keeps its own embedding (a break)
    break_every: int | None = None
    whole: bool = True  # a chunk never ends inside it (its tokens see each other both ways)
    encoded: torch.Tensor | None = None  # the tower's output while a chunk has prefilled only part of the span

    @property
    def key(self) -> tuple[int, int, bytes]:
        return self.start, self.end, self.digest

    def features(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Of its tokens [first, first + count): the offsets from `first` of those that take a feature of the tower's
        output, and those features' rows in it."""
        tokens = torch.arange(first, first + count)
        if self.break_every is None:
            return tokens - first, tokens
        width = self.break_every + 1
        kept = tokens[tokens % width != self.break_every]
        return kept - first, kept // width * self.break_every + kept % width


@dataclass(frozen=True, kw_only=True)
class DecodedImage:
    """An image preprocessed for the tower, before it is matched to its place in the prompt."""

    pixels: torch.Tensor
    grid: tuple[int, ...] | None
    tokens: int
    digest: bytes
    param: str


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
    """Turns a request's ImageData into ImageSpans for a model that takes images."""

    def __init__(self, vision: VisionSpec | None, model_path: str, tokenizer: object, max_chunk: int) -> None:
        self.vision, self.max_chunk = vision, max_chunk
        self.prompt: ImagePrompt | None = None
        self.pan_and_scan: PanAndScanPrompt | None = None
        self.broken_rows: BrokenRowsPrompt | None = None
        self.refusal = "this model takes no image input"
        if vision is None:
            return
        if vision.rows is not None:
            self._init_broken_rows(vision, model_path, tokenizer)
            return
        ids = [vision.boi_token_id, vision.image_token_id, vision.eoi_token_id]
        boi, image, eoi = tokenizer.convert_ids_to_tokens(ids)
        if None in (boi, image, eoi):
            # A checkpoint whose tokenizer lacks the image tokens: its text model serves, images are refused.
            missing = ", ".join(str(i) for i, t in zip(ids, (boi, image, eoi), strict=True) if t is None)
            self.refusal = f"this model takes no image input (its tokenizer has no token {missing})"
            log.warning("%s", self.refusal)
            self.vision = None
            return
        raw = read_processor_config(model_path)
        if vision.grid is not None:
            self.config = _qwen_config(raw, vision)
            # transformers' chat templates write this per image; the engine widens its one pad token (expand())
            self.prompt = ImagePrompt(f"{boi}{image}{eoi}", f"{boi}{image}{eoi}", None)
            return
        if vision.pooled is not None:
            self.config = _gemma4_config(raw, vision)
            # Gemma 4's template writes the image token alone; Gemma4Processor wraps it in boi / eoi
            self.prompt = ImagePrompt(image, f"{boi}{image}{eoi}", None)
            return
        size = raw.get("size") or {}
        raw = {
            **raw,
            "size": {
                "height": size.get("height") or vision.image_size,
                "width": size.get("width") or vision.image_size,
            },
        }
        self.config = gemma.GemmaImageConfig.from_dict(raw)
        if (self.config.height, self.config.width) != (vision.image_size, vision.image_size):
            raise StartupError(
                f"the image processor resizes to {self.config.width}x{self.config.height}, but the "
                f"vision tower takes {vision.image_size}x{vision.image_size}",
                param="model",
            )
        # transformers' Gemma3Processor.full_image_sequence
        self.prompt = ImagePrompt(boi, f"\n\n{boi}{image * vision.tokens_per_image}{eoi}\n\n", vision.tokens_per_image)
        if self.config.do_pan_and_scan:
            self.pan_and_scan = PanAndScanPrompt(
                tokenizer=tokenizer,
                boi=vision.boi_token_id,
                image=vision.image_token_id,
                eoi=vision.eoi_token_id,
                tokens_per_image=vision.tokens_per_image,
            )

    def _init_broken_rows(self, vision: VisionSpec, model_path: str, tokenizer: object) -> None:
        """Pixtral's layout: the break and end tokens the processor names, as the tokenizer spells them."""
        raw = read_processor_config(model_path)
        processor = _processor_json(model_path)
        names = (processor.get("image_break_token") or "[IMG_BREAK]", processor.get("image_end_token") or "[IMG_END]")
        brk, end = tokenizer.convert_tokens_to_ids(list(names))
        # (a tokenizer may answer its unknown token's id for a name it lacks: only a round trip names the token)
        brk, end = (
            i if i is not None and tokenizer.convert_ids_to_tokens(i) == n else None
            for i, n in zip((brk, end), names, strict=True)
        )
        rows = vision.rows
        rows = BrokenRows(
            patch_size=rows.patch_size,
            merge_size=rows.merge_size,
            break_token_id=rows.break_token_id if brk is None else brk,
            end_token_id=rows.end_token_id if end is None else end,
        )
        ids = [vision.image_token_id, rows.break_token_id, rows.end_token_id]
        tokens = tokenizer.convert_ids_to_tokens(ids)
        if None in tokens:
            missing = ", ".join(str(i) for i, t in zip(ids, tokens, strict=True) if t is None)
            self.refusal = f"this model takes no image input (its tokenizer has no token {missing})"
            log.warning("%s", self.refusal)
            self.vision = None
            return
        self.broken_rows = BrokenRowsPrompt(rows, vision.image_token_id)
        self.config = pixtral.PixtralImageConfig.from_dict(raw, rows.patch_size * rows.merge_size)
        self.prompt = ImagePrompt(tokens[0], tokens[0], None)  # the processor widens its one image token

    def _runs(self, prompt: list[int]) -> list[tuple[int, int]]:
        if self.broken_rows is not None:
            return self.broken_rows.runs(prompt)
        return image_runs(prompt, self.vision.image_token_id)

    def expand(self, prompt: list[int], images: list[ImageData]) -> tuple[list[int], list[DecodedImage]]:
        """Decodes the images; the prompt with each one-token placeholder widened to its image's soft tokens
        (a patch-grid tower's), or each span followed by its image's pan-and-scan crops' (the decoded images then
        list each image's crops after it). NoImageInput for images on a model that takes none."""
        if self.vision is None:
            if images:
                raise NoImageInput(self.refusal, param=images[0].param)
            return prompt, []
        parts = [self._decode(image) for image in images]  # each: the image, then its crops
        decoded = [part for image in parts for part in image]
        runs = self._runs(prompt)
        if len(runs) != len(parts):  # (a count that does not match is spans()' error; a prompt widened already runs)
            return prompt, decoded
        if self.vision.tokens_per_image is not None:
            if self.pan_and_scan is None:
                return prompt, decoded
            return self.pan_and_scan.widen(prompt, runs, [len(image) - 1 for image in parts]), decoded
        out, last = [], 0
        for (start, end), image in zip(runs, decoded, strict=True):
            if end - start > 1:
                widened = prompt[start:end]
            elif self.broken_rows is not None:
                widened = self.broken_rows.layout(image.grid)
            else:
                widened = [self.vision.image_token_id] * image.tokens
            out += prompt[last:start] + widened
            last = end
        return out + prompt[last:], decoded

    def spans(self, prompt: list[int], decoded: list[DecodedImage]) -> list[ImageSpan]:
        """The prompt's image spans with their images; InvalidRequest naming the image when they do not match."""
        if self.vision is None:
            return []
        runs = self._runs(prompt)
        if len(runs) != len(decoded):
            raise InvalidRequest(
                f"the prompt has {len(runs)} image placeholders for {len(decoded)} images: write "
                f"each image as a content part (the template places {self.prompt.placeholder})",
                param="messages",
            )
        spans = []
        grid = self.vision.grid
        for (start, end), image in zip(runs, decoded, strict=True):
            if end - start != image.tokens:
                raise InvalidRequest(
                    f"{image.param}: its placeholder has {end - start} soft tokens, not the "
                    f"{image.tokens} the image takes (a truncated prompt?)",
                    param=image.param,
                )
            if self.vision.bidirectional and end - start > self.max_chunk:
                raise InvalidRequest(
                    f"an image takes {end - start} tokens, more than max_num_batched_tokens "
                    f"({self.max_chunk}) lets one step prefill",
                    param=image.param,
                )
            if self.broken_rows is not None and prompt[start:end] != self.broken_rows.layout(image.grid):
                raise InvalidRequest(
                    f"{image.param}: its placeholder is not the image's rows of image and break tokens",
                    param=image.param,
                )
            rope = None if grid is None else (image.grid[1] // grid.merge_size, image.grid[2] // grid.merge_size)
            spans.append(
                ImageSpan(
                    start=start,
                    end=end,
                    pixels=image.pixels,
                    digest=image.digest,
                    grid=image.grid,
                    rope_grid=rope,
                    break_every=None if self.broken_rows is None else image.grid[1],
                    whole=self.vision.bidirectional,
                )
            )
        return spans

    def _decode(self, image: ImageData) -> list[DecodedImage]:
        """The image preprocessed for the tower, then its pan-and-scan crops (Gemma 3's, when the config asks)."""
        picture = decode_image(image.data, image.param)
        if self.broken_rows is not None:
            out = pixtral.preprocess(picture, self.config)
            return [self._hashed(torch.from_numpy(out.pixel_values), out.grid, out.num_tokens, image.param)]
        if self.vision.grid is not None or self.vision.pooled is not None:  # a token count that follows the image
            merged = self.vision.grid is not None  # Qwen-VL: patches merged; Gemma 4: patches pooled
            try:
                out = (qwen_vl if merged else gemma4).preprocess(picture, self.config)
            except InvalidRequest as exc:
                raise InvalidRequest(f"{image.param}: {exc.message}", param=image.param) from None
            pixels, grid = torch.from_numpy(out.pixel_values), out.grid_thw if merged else out.grid
            tokens = out.num_tokens(self.config.merge_size if merged else self.config.pooling_kernel_size)
        else:
            crops = torch.from_numpy(gemma.preprocess(picture, self.config))
            return [self._hashed(part, None, self.vision.tokens_per_image, image.param) for part in crops]
        return [self._hashed(pixels, grid, tokens, image.param)]

    @staticmethod
    def _hashed(pixels: torch.Tensor, grid: tuple[int, ...] | None, tokens: int, param: str) -> DecodedImage:
        digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16)
        digest.update(repr(grid).encode())  # two grids of the same pixel count are two pictures
        return DecodedImage(pixels=pixels, grid=grid, tokens=tokens, digest=digest.digest(), param=param)


def _processor_json(model_path: str) -> dict:
    """processor_config.json's top level (the processor's own settings, its image tokens' names); {} without it."""
    path = os.path.join(model_path, "processor_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _qwen_config(raw: dict, vision: VisionSpec) -> qwen_vl.QwenVLImageConfig:
    grid = vision.grid  # the tower's patches where the processor's settings are silent
    config = qwen_vl.QwenVLImageConfig.from_dict(
        {
            "patch_size": grid.patch_size,
            "merge_size": grid.merge_size,
            "temporal_patch_size": grid.temporal_patch_size,
            **raw,
        }
    )
    ours = (config.patch_size, config.temporal_patch_size, config.merge_size)
    if ours != (grid.patch_size, grid.temporal_patch_size, grid.merge_size):
        raise StartupError(
            f"the image processor cuts patches of (size, frames, merge) {ours}, but the vision tower "
            f"takes {(grid.patch_size, grid.temporal_patch_size, grid.merge_size)}",
            param="model",
        )
    return config


def _gemma4_config(raw: dict, vision: VisionSpec) -> gemma4.Gemma4ImageConfig:
    pooled = vision.pooled  # the tower's patches where the processor's settings are silent
    try:
        config = gemma4.Gemma4ImageConfig.from_dict(
            {"patch_size": pooled.patch_size, "pooling_kernel_size": pooled.kernel, **raw}
        )
    except ValueError as exc:
        raise StartupError(f"the image processor's settings: {exc}", param="model") from None
    ours = (config.patch_size, config.pooling_kernel_size)
    if ours != (pooled.patch_size, pooled.kernel):
        raise StartupError(
            f"the image processor cuts patches of (size, pooling) {ours}, but the vision tower takes "
            f"{(pooled.patch_size, pooled.kernel)}",
            param="model",
        )
    return config


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
