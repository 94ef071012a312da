"""A tensor-parallel rank's part of a quantized checkpoint: the slice engine/model/sharding.py gives a linear's float
weight (output rows of a column-parallel linear, input columns of a row-parallel one) carried over to each of its
format's tensors, read in whole pack words, groups and blocks. A slice that would cut one is refused in one line.

Each tensor says how it runs along the matrix's two dimensions: its layout's stacking dimension and rows per entry
along the output rows (QuantFormat's layouts), and the format's input_axis along the inputs. A tensor without such a
dimension (a per-tensor scale, per-channel scales along the inputs, a shape) is read whole by every rank.
"""

from __future__ import annotations

import torch

from engine.errors import StartupError
from engine.model.checkpoint import Source


def cuts(start: int, n: int, per: int, within_one: bool) -> bool:
    """Whether rows [start, start + n) cut an entry of `per` rows (a word, group or block). within_one: a slice
    inside one entry is whole too (a block scale read for part of its rows: the KV rows of one head)."""
    if start % per == 0 and n % per == 0:
        return False
    return not (within_one and per % n == 0 and start % n == 0)


def quantized_sources(
    fmt, sources: dict[str, Source], ours: dict[str, tuple[int, ...]], matrices: list[str], size: int
) -> dict[str, Source]:
    """Our checkpoint names (`matrices`, without a suffix) whose float weight a rank reads in part -> the part of
    each of the format's tensors it reads instead; `ours` (our names -> checkpoint shapes) takes those parts' shapes.
    StartupError in one line naming the numbers when a part would cut a word, group or block."""
    out: dict[str, Source] = {}
    for matrix in matrices:
        part = sources.get(f"{matrix}.weight")
        if part is None:
            continue
        for layout in fmt.layouts:
            name = f"{matrix}.{layout.suffix}"
            if name not in ours:
                continue
            rows = part.dim == 0
            axis = (
                (None if layout.dim is None else (layout.dim, layout.rows_per_entry))
                if rows
                else fmt.input_axis(layout)
            )
            if axis is None:  # this tensor holds no such dimension: every rank reads it whole
                continue
            dim, per = axis
            spans = []
            for start, n in part.spans:
                # NOTE: a part inside one block is whole only as a matrix of its own: parts side by side (a DeltaNet's
                # q|k|v) must each be whole blocks, for the rank's matrix to keep one block grid.
                if cuts(start, n, per, rows and layout.ragged and len(part.spans) == 1):
                    what = "output rows" if rows else "inputs"
                    raise StartupError(
                        f"tensor_parallel_size={size} would cut {fmt.name}'s {layout.suffix} of "
                        f"{matrix} ({per} {what} an entry): a rank holds {n} {what} from {start}",
                        param="tensor_parallel_size",
                    )
                spans.append((start // per, max(n // per, 1)))
            out[name] = Source(dim, tuple(spans))
            ours[name] = out[name].shape(ours[name])
    return out


def input_positions(part: Source | None, in_features: int) -> torch.Tensor:
    """The checkpoint's input columns a linear holds, in order: all of them, or a row-parallel rank's."""
    if part is None or part.dim != 1:
        return torch.arange(in_features)
    return torch.cat([torch.arange(start, start + n) for start, n in part.spans])
