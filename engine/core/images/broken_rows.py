"""Pixtral's image layout in the prompt (Mistral 3, transformers' PixtralProcessor.replace_image_token): an image of
rows x columns merged patches is `rows` runs of `columns` image tokens, each followed by the break token, the last by
the end token instead. The chat template writes one image token per image; widen() puts the layout there."""

from __future__ import annotations

from engine.model.vision.spec import BrokenRows


class BrokenRowsPrompt:
    """Finds, widens and checks the images' layouts in a prompt."""

    def __init__(self, rows: BrokenRows, image_token_id: int) -> None:
        self.image, self.brk, self.end = image_token_id, rows.break_token_id, rows.end_token_id

    def layout(self, grid: tuple[int, int]) -> list[int]:
        """The tokens an image of `grid` (rows, columns of merged patches) takes."""
        rows, cols = grid
        return ([self.image] * cols + [self.brk]) * (rows - 1) + [self.image] * cols + [self.end]

    def runs(self, prompt: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each image: a whole layout (image and break tokens up to the end token), or a lone image
        token (the template's placeholder; so is each of several side by side that no end token closes)."""
        runs: list[tuple[int, int]] = []
        i, n = 0, len(prompt)
        while i < n:
            if prompt[i] != self.image:
                i += 1
                continue
            j = i
            while j < n and prompt[j] in (self.image, self.brk):
                j += 1
            if j < n and prompt[j] == self.end:
                runs.append((i, j + 1))
            else:
                runs += [(k, k + 1) for k in range(i, j) if prompt[k] == self.image]
            i = j + 1
        return runs
