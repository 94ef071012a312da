"""Gemma 3's pan-and-scan prompt: an image with crops becomes the original image's span, then one more span per crop,
with the text transformers' Gemma3Processor writes around them, as token ids of the model's own tokenizer.

Gemma3Processor.replace_image_token writes "Here is the original image {full} and here are some crops to help you
see better " + " ".join([full] * crops) where the template wrote the image, `full` being "\\n\\n{boi}{soft tokens}
{eoi}\\n\\n" (the expansion the worker wrote already). The tokenizer splits text at its added tokens (boi, eoi) and
tokenizes what lies between on its own, so the text after the last crop's eoi tokenizes as it did, the pieces
between spans are constants, and only the text between the previous added token and the original's boi is
tokenized again (it gains "Here is the original image ", which may merge with the text before it)."""

from __future__ import annotations

from typing import Any

ORIGINAL = "Here is the original image "
AFTER_ORIGINAL = "\n\n and here are some crops to help you see better \n\n"  # eoi ... boi of the first crop
BETWEEN_CROPS = "\n\n \n\n"  # eoi ... boi of the next crop


class PanAndScanPrompt:
    """Widens a prompt's image spans by their images' pan-and-scan crops."""

    def __init__(self, *, tokenizer: Any, boi: int, image: int, eoi: int, tokens_per_image: int) -> None:
        self.tokenizer = tokenizer
        self.splits = set(tokenizer.added_tokens_decoder) | {boi, eoi}
        self.span = [boi] + [image] * tokens_per_image + [eoi]
        self.after_original = tokenizer.encode(AFTER_ORIGINAL, add_special_tokens=False)
        self.between_crops = tokenizer.encode(BETWEEN_CROPS, add_special_tokens=False)

    def widen(self, prompt: list[int], runs: list[tuple[int, int]], crops: list[int]) -> list[int]:
        """The prompt with each image's span (runs[i], its soft tokens between boi and eoi) followed by crops[i]
        more; an image without crops is left as it is."""
        out, last = [], 0
        for (start, end), n in zip(runs, crops, strict=True):
            boi = start - 1
            if not n or prompt[boi : end + 1] != self.span:  # (a span not between boi and eoi is spans()' error)
                continue
            head = max((i for i in range(last, boi) if prompt[i] in self.splits), default=last - 1) + 1
            text = self.tokenizer.decode(prompt[head:boi], clean_up_tokenization_spaces=False)
            text = text[:-2] + ORIGINAL + "\n\n" if text.endswith("\n\n") else text + ORIGINAL
            out += prompt[last:head] + self.tokenizer.encode(text, add_special_tokens=False) + self.span
            out += self.after_original + self.span
            for _ in range(n - 1):
                out += self.between_crops + self.span
            last = end + 1  # past the original's eoi: the text after the last crop's eoi is the same
        return out + prompt[last:]
