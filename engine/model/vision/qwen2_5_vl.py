"""Qwen2.5-VL's vision transformer (transformers' Qwen2_5_VisionTransformerPretrainedModel): each image arrives as
its patches, listed 2x2 merge block by block (engine/image/qwen_vl.py), and its grid (1, h, w). A patch embedding
(a Conv3d without bias whose kernel is the whole patch, run as one matrix), no learned positions, then pre-RMSNorm
blocks with 2-D rotary and a SwiGLU MLP. The blocks attend within windows of window_size pixels (windows.py: the
patches listed window by window), except those of fullatt_block_indexes, which attend over the whole image; the
merger (RMSNorm, each 2x2 block's four patches side by side, a GELU MLP into the text width) ends it, its tokens put
back in the image's order. Parameter names are the hub's (visual.*)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.activation import silu_and_mul
from engine.model.layers.linear import FusedLinear, PatchKernelLinear
from engine.model.layers.linear_post import linear_add, linear_gelu
from engine.model.layers.norm import RMSNorm
from engine.model.vision.qwen_vl import VisionAttention, read_tower_fields, vision_rotary
from engine.model.vision.windows import window_order


@dataclass(frozen=True, kw_only=True)
class Qwen2_5VisionArgs:
    """vision_config's fields (transformers' Qwen2_5_VLVisionConfig defaults where it is silent)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, raw: dict) -> Qwen2_5VisionArgs:
        act = raw.get("hidden_act") or "silu"
        if act != "silu":
            raise UnsupportedModel(f"vision_config.hidden_act {act!r} is not supported (silu)", param="model")
        fields = read_tower_fields(raw, "window_size")
        if raw.get("fullatt_block_indexes") is not None:
            fields["fullatt_block_indexes"] = tuple(raw["fullatt_block_indexes"])
        args = cls(**fields)
        if args.hidden_size % args.num_heads or args.head_dim % 4 or args.window_side < 1:
            raise UnsupportedModel(
                "vision_config: hidden_size / num_heads must be a multiple of 4 and window_size at least "
                "patch_size * spatial_merge_size",
                param="model",
            )
        return args

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_side(self) -> int:
        """A window's side in merge units."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def deepstack_visual_indexes(self) -> tuple[int, ...]:
        return ()  # none: the decoder adds no tower features after its first layers


class VisionMLP(nn.Module):
    """SwiGLU with biases, gate_proj | up_proj read into one matrix."""

    def __init__(self, a: Qwen2_5VisionArgs) -> None:
        super().__init__()
        n = a.intermediate_size
        self.gate_up_proj = FusedLinear(a.hidden_size, {"gate_proj": n, "up_proj": n}, bias=True)
        self.down_proj = nn.Linear(n, a.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return linear_add(self.down_proj, silu_and_mul(self.gate_up_proj(x)), residual)


class VisionBlock(nn.Module):
    def __init__(self, a: Qwen2_5VisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(a.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(a.hidden_size, eps=1e-6)
        self.attn = VisionAttention(a.hidden_size, a.num_heads)
        self.mlp = VisionMLP(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attn(self.norm1(x), cos, sin, lengths, residual=x)
        return self.mlp(self.norm2(x), residual=x)


class PatchMerger(nn.Module):
    """A 2x2 block of patches -> one text-width token: RMSNorm per patch, the four side by side, Linear, GELU,
    Linear (the hub's ln_q, mlp.0, mlp.2)."""

    def __init__(self, a: Qwen2_5VisionArgs) -> None:
        super().__init__()
        self.width = a.hidden_size * a.spatial_merge_size**2
        self.ln_q = RMSNorm(a.hidden_size, eps=1e-6)
        self.mlp = nn.ModuleList(
            [nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, a.out_hidden_size)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp[2](linear_gelu(self.mlp[0], self.ln_q(x).view(-1, self.width), "none"))


class PatchEmbed(nn.Module):
    """Holds the patch embedding under the hub's name (patch_embed.proj)."""

    def __init__(self, a: Qwen2_5VisionArgs) -> None:
        super().__init__()
        kernel = (a.temporal_patch_size, a.patch_size, a.patch_size)
        self.proj = PatchKernelLinear(a.in_channels, a.hidden_size, kernel, bias=False)


class Qwen2_5VisionTower(nn.Module):
    """Images' patches and grids -> per image [h * w / merge^2, out_hidden_size]."""

    def __init__(self, a: Qwen2_5VisionArgs) -> None:
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.blocks = nn.ModuleList(VisionBlock(a) for _ in range(a.depth))
        self.merger = PatchMerger(a)

    def forward(self, patches: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        if any(t != 1 for t, _, _ in grids):
            raise ValueError("the vision tower takes images (one frame each), not videos")
        a, unit = self.args, self.args.spatial_merge_size**2
        images = [h * w for _, h, w in grids]
        windows = window_order(grids, merge=a.spatial_merge_size, side=a.window_side)
        order = windows.patches(unit).to(patches[0].device)
        dtype = self.merger.ln_q.weight.dtype  # the model's (a packed linear has no weight)
        x = self.patch_embed.proj(torch.cat(patches).to(dtype)[order])
        cos, sin = vision_rotary(
            grids, head_dim=a.head_dim, theta=a.rope_theta, merge=a.spatial_merge_size, device=x.device
        )
        cos, sin = cos[order], sin[order]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, images if i in a.fullatt_block_indexes else windows.lengths)
        merged = self.merger(x)[torch.argsort(windows.units.to(x.device))]  # back in the image's order
        return list(merged.split([n // unit for n in images]))
