"""A safetensors checkpoint: its files, its tensors' names and shapes, and copying them into our modules.

Each checkpoint tensor goes to one target: a parameter of the same name, or one shard of a parameter that stacks
several checkpoint tensors (q|k|v, gate|up, experts). A module that stacks declares it with
`checkpoint_shards()`; a family renames hub names to ours with `checkpoint_name()`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from glob import glob

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.kv_scales import kv_scale_target

# Buffers some checkpoints carry that we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Source:
    """The part of a checkpoint tensor that one tensor-parallel rank reads: `spans` (start, size) of dimension
    `dim`, concatenated (two spans where a fused hub tensor stacks gate|up). Read through the file's memory map,
    so a rank never holds more than its part."""

    dim: int
    spans: tuple[tuple[int, int], ...]
    # The whole size of `dim`, where a tensor may be stored with its last two dimensions swapped (Qwen3-VL-MoE's
    # experts: the hub's [E, in, out] or transformers 5's [E, out, in]): a tensor without it there is cut along the
    # other of the two. None: always along `dim`.
    size: int | None = None

    def axis(self, shape: tuple[int, ...]) -> int:
        """The dimension this part cuts in a tensor of `shape`."""
        if self.size is None or shape[self.dim] == self.size:
            return self.dim
        return len(shape) - 1 if self.dim == len(shape) - 2 else len(shape) - 2

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.axis(shape)] = sum(n for _, n in self.spans)
        return tuple(out)

    def read(self, handle) -> torch.Tensor:
        """This part of the tensor behind a safetensors slice handle (f.get_slice(name))."""
        dim = self.dim if self.size is None else self.axis(tuple(handle.get_shape()))
        lead = (slice(None),) * dim
        pieces = [handle[(*lead, slice(start, start + n))] for start, n in self.spans]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


@dataclass(frozen=True, kw_only=True)
class Shard:
    """Where one checkpoint tensor lands inside a stacked parameter: `param`[index] (an expert), then entries
    [offset, offset + size) of that along `dim` (None: all of it).

    `dim` is 0 (rows) for a float weight; a quantized layout that stacks along another dimension says so, such
    as AWQ's qweight [in, out / 8], whose q|k|v stack along dim 1 in packed columns. `transposed`: the checkpoint
    stores the parameter with its last two dimensions swapped (gpt-oss's experts, [E, in, out]); None: the tensor's
    shape says which (Qwen3-VL-MoE's experts: the hub's [E, in, out], or transformers 5's own [E, out, in]).
    `shape`: the checkpoint stores the parameter in this shape, the same elements in the same order (a patch
    convolution's kernel that the model holds as the matrix it is).
    """

    param: str
    index: int | None = None
    offset: int = 0
    size: int | None = None
    dim: int = 0
    transposed: bool | None = False
    source: Source | None = None  # a tensor-parallel rank's part of the checkpoint tensor (None: all of it)
    shape: tuple[int, ...] | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.shape is not None:
            tensor = tensor.view(self.shape)
        if self.transposed:
            tensor = tensor.transpose(-1, -2)
        if self.index is not None:
            tensor = tensor[self.index]
        return tensor if self.size is None else tensor.narrow(self.dim, self.offset, self.size)


def safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise UnsupportedModel(f"no *.safetensors weights in {model_path}", param="model")
    return files


def tensor_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, read from the files' headers (no data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:  # a truncated or missing shard: one line, not a traceback
            raise UnsupportedModel(
                f"{os.path.basename(path)} cannot be read as safetensors: {exc}", param="model"
            ) from None
    return shapes


def shard_targets(model: nn.Module) -> dict[str, Shard]:
    """Checkpoint name -> its shard, for every module that stacks checkpoint tensors."""
    targets: dict[str, Shard] = {}
    for prefix, module in model.named_modules():
        shards = getattr(module, "checkpoint_shards", None)
        if shards is None:
            continue
        base = prefix.rsplit(".", 1)[0] + "." if "." in prefix else ""
        for name, shard in shards(prefix).items():
            targets[base + name] = shard
    return targets


def plan_copies(model: nn.Module, shapes: dict[str, tuple[int, ...]], tied: bool) -> dict[str, Shard]:
    """Checkpoint name -> its target, for every tensor to copy; raises UnsupportedModel on a tensor we do
    not expect, one of the wrong shape, or a parameter no tensor fills. Reads no data (shapes only).

    A tensor-parallel shard's `checkpoint_sources` (our name -> Source) say which part of a tensor it reads; a
    vision tower's modules (TOWER_MODULES) set to None on a rank that does not run them read none of theirs."""
    params = dict(model.named_parameters())
    targets = shard_targets(model)
    sources: dict[str, Source] = getattr(model, "checkpoint_sources", None) or {}
    rename = getattr(model, "checkpoint_name", lambda n: n)
    dropped = {name for name in getattr(model, "TOWER_MODULES", ()) if getattr(model, name, None) is None}
    filled: dict[str, int] = {}  # param -> elements written
    plan: dict[str, Shard] = {}
    for name, shape in shapes.items():
        ours = rename(name)
        if ours is None or ours.endswith(IGNORED_SUFFIXES) or (tied and ours == "lm_head.weight"):
            continue
        if ours.split(".", 1)[0] in dropped:
            continue
        if kv_scale_target(ours) is not None:  # not a weight: engine.model.kv_scales reads these
            continue
        shard = targets.get(ours) or (Shard(param=ours) if ours in params else None)
        if shard is None:
            raise UnsupportedModel(f"unexpected tensor {name!r} in checkpoint", param="model")
        if ours in sources:
            shard = replace(shard, source=sources[ours])
            shape = sources[ours].shape(shape)
        if shard.transposed is None:
            as_is = tuple(replace(shard, transposed=False).view(params[shard.param].data).shape)
            shard = replace(shard, transposed=as_is != shape)
        expected = tuple(shard.view(params[shard.param].data).shape)
        if expected != shape:
            raise UnsupportedModel(f"tensor {name!r} has shape {shape}, expected {expected}", param="model")
        filled[shard.param] = filled.get(shard.param, 0) + _numel(shape)
        plan[name] = shard
    missing = [p for p, t in params.items() if filled.get(p, 0) < t.numel() and not (tied and p == "lm_head.weight")]
    if missing:
        raise UnsupportedModel(f"checkpoint lacks tensors for: {', '.join(sorted(missing)[:8])}", param="model")
    return plan


def load_weights(model: nn.Module, files: list[str], shapes: dict[str, tuple[int, ...]], tied: bool) -> None:
    """Copies every checkpoint tensor into its target (cast to the parameter's dtype)."""
    params = dict(model.named_parameters())
    plan = plan_copies(model, shapes, tied)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in plan:
                    shard = plan[name]
                    tensor = f.get_tensor(name) if shard.source is None else shard.source.read(f.get_slice(name))
                    shard.view(params[shard.param].data).copy_(tensor)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
