"""The linear-method seam: a quantized checkpoint's linears hold the checkpoint's own tensors while it loads, then
become the serving form of their format (an int4 kernel's layout, or a weight dequantised to the serving dtype).

The model files never see a quantized tensor: the loader swaps their nn.Linear / FusedLinear modules (and each
MoE expert's projections) for CheckpointLinear before the checkpoint is copied in, and for the serving module
right after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import StartupError, UnsupportedModel
from engine.model.checkpoint import Shard, Source, shard_targets
from engine.model.layers.mla import HeadWeights
from engine.model.layers.moe import StackedExperts
from engine.model.layers.routing import ScoreLinear
from engine.model.quant.shards import quantized_sources

# A hub MoE checkpoint's projections of each expert ('mlp.experts.3.gate_proj'; Mixtral's w1/w3/w2 renamed to these).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """One checkpoint tensor of a quantized linear, kept in `dtype` (a cast that loses nothing: fp16 scales go to
    float32). `dim`: the dimension along which stacked matrices (q|k|v) sit, with `rows_per_entry` output rows per
    entry along it (8 for a nibble-packed dimension, 128 for a block scale); None: one per matrix (a per-tensor
    scale, a shape), held as param[i]. `ragged`: a matrix whose rows are not a multiple of rows_per_entry ends
    on a partial entry of its own (a block scale of a 64-row K projection), so it still stacks with its siblings;
    CheckpointLinear.rows_per_matrix spreads such entries over their rows."""

    suffix: str
    dtype: torch.dtype
    dim: int | None = 0
    rows_per_entry: int = 1
    required: bool = True
    ragged: bool = False


class QuantFormat:
    """One checkpoint format: its tensors, their float32 dequantisation and the module that serves them."""

    name: str = ""
    layouts: tuple[TensorLayout, ...] = ()
    tensor_parallel = False  # its linears shard along whole words, groups and blocks (quant/shards.py)

    @property
    def marker(self) -> str:
        """The tensor whose presence marks a linear of the checkpoint as quantized in this format."""
        return self.layouts[0].suffix

    def dequantize(self, linear: CheckpointLinear) -> torch.Tensor:
        """The exact float32 [out, in] weight the checkpoint stores."""
        raise NotImplementedError

    def expected_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        """The shapes this format stores for one [rows, in_features] matrix, by tensor (those it can check); raises
        UnsupportedModel naming the dimension when the format cannot hold such a matrix at all."""
        return {}

    def serving_module(self, linear: CheckpointLinear, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The module that serves `linear` (default: its weight dequantised to `dtype`)."""
        return dense_linear(linear, self.dequantize(linear), dtype)

    def input_axis(self, layout: TensorLayout) -> tuple[int, int] | None:
        """(dimension, inputs per entry) of `layout`'s tensor along the matrix's inputs; None: it has none (a
        per-tensor or per-channel scale), and a row-parallel rank reads it whole."""
        return None

    def check_shard(self, args: object, size: int) -> None:
        """StartupError in one line unless `size` tensor-parallel ranks can split this format's tensors (default:
        a tensor_parallel format's linears are checked as they are sliced; any other does not shard yet)."""
        if self.tensor_parallel:
            return
        raise StartupError(
            f"tensor parallelism does not shard {self.name} checkpoints yet: serve it with tensor_parallel_size=1",
            param="tensor_parallel_size",
        )

    def swap(self, model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> int:
        """Before loading: the modules that hold this format's tensors take their checkpoint layout (default:
        linears become CheckpointLinear). Returns how many."""
        return swap_quantized_linears(model, self, shapes)

    def serve(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        """After loading: those modules become their serving form."""
        to_serving(model, dtype, device)


class CheckpointLinear(nn.Module):
    """A linear as the checkpoint stores it: one parameter per tensor of the format, stacked over its matrices
    (q|k|v, gate|up) as the layout says. `shards`: checkpoint module name -> output rows, in stacking order.
    `head_weights`: it stands for an MLA layer's kv_b_proj (HeadWeights), served as its dequantised weight."""

    checkpoint_dtypes = True  # the loader keeps these parameters' dtypes instead of casting to the serving one

    def __init__(
        self,
        *,
        fmt: QuantFormat,
        shards: dict[str, int],
        in_features: int,
        bias: bool,
        shapes: dict[str, tuple[int, ...]],
        head_weights: bool = False,
    ) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, sum(shards.values())
        self.head_weights = head_weights
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        # A tensor-parallel rank's part of each matrix's float weight (quant/shards.py); empty: all of them.
        self.matrix_sources: dict[str, Source] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.present = [layout for layout in fmt.layouts if layout.suffix in shapes]
        for layout in fmt.layouts:
            if layout.required and layout not in self.present:
                raise UnsupportedModel(
                    f"{fmt.name} checkpoint lacks {next(iter(shards))}.{layout.suffix}", param="model"
                )
        for layout in self.present:
            shape = list(shapes[layout.suffix])
            if layout.dim is None:
                shape = [len(shards), *shape]
            else:
                shape[layout.dim] = sum(self._entries(layout, size) for size in shards.values())
            self.register_parameter(
                layout.suffix, nn.Parameter(torch.empty(shape, dtype=layout.dtype, device="meta"), requires_grad=False)
            )
        self.bias = nn.Parameter(torch.empty(self.out_features, device="meta"), requires_grad=False) if bias else None

    def _entries(self, layout: TensorLayout, size: int) -> int:
        if len(self.shard_offsets) > 1 and size % layout.rows_per_entry and not layout.ragged:
            raise UnsupportedModel(
                f"{self.fmt.name}: {layout.suffix} of a {size}-row matrix cannot be stacked with its siblings "
                f"({layout.rows_per_entry} rows per entry)",
                param="model",
            )
        return math.ceil(size / layout.rows_per_entry)

    def checkpoint_shards(self, prefix: str) -> dict[str, Shard]:
        """'q_proj.qweight' (a sibling of this module in the checkpoint) -> its place in our stacked tensor."""
        out: dict[str, Shard] = {}
        entries = dict.fromkeys((layout.suffix for layout in self.present), 0)
        for i, (name, (offset, size)) in enumerate(self.shard_offsets.items()):
            for layout in self.present:
                if layout.dim is None:
                    out[f"{name}.{layout.suffix}"] = Shard(param=f"{prefix}.{layout.suffix}", index=i)
                    continue
                n = self._entries(layout, size)
                out[f"{name}.{layout.suffix}"] = Shard(
                    param=f"{prefix}.{layout.suffix}", offset=entries[layout.suffix], size=n, dim=layout.dim
                )
                entries[layout.suffix] += n
            if self.bias is not None:
                out[f"{name}.bias"] = Shard(param=f"{prefix}.bias", offset=offset, size=size)
        return out

    def tensor(self, suffix: str) -> torch.Tensor | None:
        """The stacked checkpoint tensor, or None when the checkpoint has none of that name."""
        return getattr(self, suffix, None)

    def rows_per_matrix(self, values: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """A stacked tensor of `layout` whose entries each cover rows_per_entry output rows, repeated over those
        rows matrix by matrix (a ragged matrix's partial last entry covers only the rows it has): [out, ...]."""
        parts, entry = [], 0
        for _, size in self.shard_offsets.values():
            n = self._entries(layout, size)
            parts.append(values[entry : entry + n].repeat_interleave(layout.rows_per_entry, dim=0)[:size])
            entry += n
        return torch.cat(parts)

    def rows_of_each(self, values: torch.Tensor) -> torch.Tensor:
        """A per-matrix tensor [matrices, ...] (one per-tensor scale each) repeated over each matrix's rows."""
        sizes = torch.tensor([size for _, size in self.shard_offsets.values()], device=values.device)
        return values.reshape(len(sizes), -1)[:, :1].repeat_interleave(sizes, dim=0)


def dense_linear(linear: CheckpointLinear, weight: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    """An nn.Linear of `dtype` holding `weight`; it keeps the stacked matrices' offsets (LoRA reads them)."""
    out = nn.Linear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, device=weight.device, dtype=dtype
    )
    out.weight.data.copy_(weight)
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias)
    out.requires_grad_(False)
    out.shard_offsets = linear.shard_offsets
    return out


def swap_quantized_linears(model: nn.Module, fmt: QuantFormat, shapes: dict[str, tuple[int, ...]]) -> int:
    """Replaces each Linear whose checkpoint matrices carry the format's marker tensor with a CheckpointLinear,
    and so each expert projection (swap_quantized_experts) and MLA's kv_b_proj (HeadWeights, dequantised at load
    as vLLM does: the absorbed attention reads it per head); those the checkpoint left in float (an ignored
    lm_head, a router) stay. Returns how many."""
    rename = getattr(model, "checkpoint_name", lambda n: n)
    ours = {rename(n): s for n, s in shapes.items()}
    swapped = swap_quantized_experts(model, fmt, ours)
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear | HeadWeights):
                continue
            base = f"{prefix}." if prefix else ""
            offsets = getattr(child, "shard_offsets", None)
            shards = {n: size for n, (_, size) in offsets.items()} if offsets else {name: child.out_features}
            if f"{base}{next(iter(shards))}.{fmt.marker}" not in ours:
                continue
            linear = _checkpoint_linear(
                model,
                fmt,
                ours,
                base,
                shards,
                child.in_features,
                bias=getattr(child, "bias", None) is not None,
                head_weights=isinstance(child, HeadWeights),
            )
            setattr(parent, name, linear)
            swapped += 1
    if not swapped:
        raise UnsupportedModel(
            f"quantization_config says {fmt.name} but no linear has its {fmt.marker!r} tensor", param="model"
        )
    refuse_unswapped(fmt, model, ours)
    return swapped


def swap_quantized_experts(model: nn.Module, fmt: QuantFormat, ours: dict[str, tuple[int, ...]]) -> int:
    """Each expert stack whose hub per-expert projections carry the format's tensors ('experts.3.gate_proj.qweight',
    as AWQ, GPTQ and FP8 MoE checkpoints store them) runs one CheckpointLinear per expert for gate|up and one for
    down; returns how many. `ours`: the checkpoint's shapes under our names."""
    swapped = 0
    for prefix, module in list(model.named_modules()):
        if isinstance(module, ScoreLinear) and f"{prefix}.{fmt.marker}" in ours:
            kind = "shared-expert gate" if prefix.endswith("shared_expert_gate") else "router"
            raise UnsupportedModel(
                f"{fmt.name}: the {kind} {prefix} is quantized in this checkpoint; the engine "
                f"runs {kind}s in float (modules_to_not_convert / ignore)",
                param="model",
            )
        if not isinstance(module, StackedExperts):
            continue
        names = [f"{prefix}.{e}.{proj}" for e in range(module.num_experts) for proj in EXPERT_PROJECTIONS]
        floats = [n for n in names if f"{n}.{fmt.marker}" not in ours]
        if len(floats) == len(names):
            continue
        if floats:  # NOTE: an expert stack is served all quantized or all float
            raise UnsupportedModel(
                f"{fmt.name}: {floats[0]} is not quantized while other experts of {prefix} are", param="model"
            )
        inner, hidden = module.intermediate_size, module.hidden_size
        module.use_expert_linears(
            [
                (
                    _checkpoint_linear(
                        model, fmt, ours, f"{prefix}.{e}.", {"gate_proj": inner, "up_proj": inner}, hidden
                    ),
                    _checkpoint_linear(model, fmt, ours, f"{prefix}.{e}.", {"down_proj": hidden}, inner),
                )
                for e in range(module.num_experts)
            ]
        )
        swapped += 2 * module.num_experts
    return swapped


def _checkpoint_linear(
    model: nn.Module,
    fmt: QuantFormat,
    ours: dict[str, tuple[int, ...]],
    base: str,
    shards: dict[str, int],
    in_features: int,
    bias: bool = False,
    head_weights: bool = False,
) -> CheckpointLinear:
    """A CheckpointLinear for the checkpoint matrices `base` + each shard name, shaped after the first one's, whose
    tensors must be the format's for that matrix (its siblings are then held to it by the checkpoint's plan). In a
    tensor-parallel shard (model.checkpoint_sources), each tensor's part that the rank reads."""
    sources = getattr(model, "checkpoint_sources", None)
    parts: dict[str, Source] = {}
    if sources:
        sources.update(quantized_sources(fmt, sources, ours, [base + n for n in shards], model.tp.size))
        parts = {n: sources[f"{base}{n}.weight"] for n in shards if f"{base}{n}.weight" in sources}
    name, rows = next(iter(shards.items()))
    first = base + name
    tensors = {
        layout.suffix: ours[f"{first}.{layout.suffix}"] for layout in fmt.layouts if f"{first}.{layout.suffix}" in ours
    }
    try:
        expected = fmt.expected_shapes(rows, in_features)
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"{fmt.name}: {first} {exc.message}", param="model") from None
    for suffix, shape in expected.items():
        if suffix in tensors and tuple(tensors[suffix]) != shape:
            raise UnsupportedModel(
                f"{fmt.name}: {first}.{suffix} has shape {tuple(tensors[suffix])}, expected {shape} "
                f"for a {in_features} -> {rows} linear",
                param="model",
            )
    linear = CheckpointLinear(
        fmt=fmt, shards=shards, in_features=in_features, bias=bias, shapes=tensors, head_weights=head_weights
    )
    linear.matrix_sources = parts
    return linear


def refuse_unswapped(fmt: QuantFormat, model: nn.Module, ours: dict[str, tuple[int, ...]]) -> None:
    """One line for a module the checkpoint quantized that the engine runs in float (a conv1d, a norm), rather than
    the plan's 'unexpected tensor' on its scale. `ours`: the checkpoint's shapes under our names."""
    targets, params = shard_targets(model), dict(model.named_parameters())
    for name in ours:
        if name is not None and name.endswith(f".{fmt.marker}") and name not in targets and name not in params:
            raise UnsupportedModel(
                f"{fmt.name}: {name.removesuffix('.' + fmt.marker)} is quantized in this "
                "checkpoint; the engine runs it unquantized (modules_to_not_convert / ignore)",
                param="model",
            )


def to_serving(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replaces each loaded CheckpointLinear with its format's serving module (MLA's kv_b_proj: HeadWeights holding
    its exact dequantised weight in `dtype`)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointLinear) and child.head_weights:
                weight = child.fmt.dequantize(child).to(dtype)
                setattr(parent, name, HeadWeights(child.in_features, child.out_features, weight=weight))
            elif isinstance(child, CheckpointLinear):
                setattr(parent, name, child.fmt.serving_module(child, dtype, device))
