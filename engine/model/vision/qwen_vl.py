"""Qwen3-VL's and Qwen3.5's vision transformer (transformers' Qwen3VLVisionModel, Qwen3_5VisionModel): each image
arrives as its patches ([h * w, channels * temporal_patch_size * patch^2], listed 2x2 merge block by block, as
engine/image/qwen_vl.py cuts them) and its grid (1, h, w). A patch embedding (a Conv3d whose kernel is the whole
patch, run as one matrix), learned positions resampled bilinearly (corners aligned) from their square grid to the
image's, pre-norm blocks with 2-D rotary (row and column halves) and full attention within each image, then the
merger: each 2x2 block's four patches side by side, LayerNorm, a GELU MLP into the text width. Qwen3-VL's
deepstack mergers read the blocks of `deepstack_visual_indexes` the same way (their LayerNorm after the 2x2
shuffle); their features go beside the merger's, one text width each, for the decoder's first layers to add.
Parameter names are the hub's (model.visual.*)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.linear import PatchKernelLinear
from engine.model.layers.linear_post import linear_add, linear_gelu
from engine.model.layers.rotary import full_width_rotary, rotate_pairs
from engine.model.vision.attention import image_attention

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu's approximate
# The vision_config fields every Qwen-VL tower (Qwen2.5-VL's, Qwen3-VL's, Qwen3.5's) reads under these names
TOWER_FIELDS = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "out_hidden_size",
)


def read_tower_fields(raw: dict, *extra: str) -> dict:
    """The tower's fields (and `extra` ones) that vision_config sets, the args' defaults standing for the rest, and
    rope_theta (rope_parameters' first, then the top level's, else 10000)."""
    fields = {k: raw[k] for k in (*TOWER_FIELDS, *extra) if raw.get(k) is not None}
    theta = (raw.get("rope_parameters") or {}).get("rope_theta") or raw.get("rope_theta") or 10000.0
    return {**fields, "rope_theta": float(theta)}


@dataclass(frozen=True, kw_only=True)
class QwenVisionArgs:
    """vision_config's fields (transformers' Qwen3VLVisionConfig defaults where it is silent)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    gelu: str = "tanh"

    @classmethod
    def from_config(cls, raw: dict) -> QwenVisionArgs:
        act = raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise UnsupportedModel(
                f"vision_config.hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})", param="model"
            )
        args = cls(
            **read_tower_fields(raw, "num_position_embeddings"),
            deepstack_visual_indexes=tuple(raw.get("deepstack_visual_indexes") or ()),
            gelu=ACTIVATIONS[act],
        )
        side = round(args.num_position_embeddings**0.5)
        if (
            args.hidden_size % args.num_heads
            or (args.hidden_size // args.num_heads) % 4
            or side * side != args.num_position_embeddings
        ):
            raise UnsupportedModel(
                "vision_config: hidden_size / num_heads must be a multiple of 4 and num_position_embeddings a square",
                param="model",
            )
        return args

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class VisionAttention(nn.Module):
    """qkv (with bias), 2-D rotary on q and k, attention within each run of `lengths` patches, proj."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int], residual: torch.Tensor
    ) -> torch.Tensor:
        """residual + attention(x)."""
        n, width = x.shape
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        # q and k rotated together in float32 (cos and sin's dtype) as transformers does, whatever the serving dtype.
        q, k = rotate_pairs(qkv[:, :2], cos, sin).to(x.dtype).unbind(1)
        return linear_add(self.proj, image_attention(q, k, qkv[:, 2], lengths).reshape(n, width), residual)


class VisionMLP(nn.Module):
    def __init__(self, a: QwenVisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.linear_fc2 = nn.Linear(a.intermediate_size, a.hidden_size)
        self.approximate = a.gelu

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return linear_add(self.linear_fc2, linear_gelu(self.linear_fc1, x, self.approximate), residual)


class VisionBlock(nn.Module):
    def __init__(self, a: QwenVisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(a.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(a.hidden_size, eps=1e-6)
        self.attn = VisionAttention(a.hidden_size, a.num_heads)
        self.mlp = VisionMLP(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attn(self.norm1(x), cos, sin, lengths, residual=x)
        return self.mlp(self.norm2(x), residual=x)


class PatchMerger(nn.Module):
    """A 2x2 block of patches -> one text-width token. postshuffle (the deepstack mergers): the LayerNorm runs over
    the four patches side by side rather than over each."""

    def __init__(self, a: QwenVisionArgs, postshuffle: bool) -> None:
        super().__init__()
        self.width = a.hidden_size * a.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else a.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, a.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(linear_gelu(self.linear_fc1, x, "none"))


class PatchEmbed(nn.Module):
    """Holds the patch embedding under the hub's name (patch_embed.proj)."""

    def __init__(self, a: QwenVisionArgs) -> None:
        super().__init__()
        self.proj = PatchKernelLinear(a.in_channels, a.hidden_size, (a.temporal_patch_size, a.patch_size, a.patch_size))


class QwenVisionTower(nn.Module):
    """Images' patches and grids -> per image [h * w / merge^2, out_hidden_size * (1 + deepstack layers)]."""

    def __init__(self, a: QwenVisionArgs) -> None:
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.pos_embed = nn.Embedding(
            a.num_position_embeddings, a.hidden_size, _weight=torch.empty(a.num_position_embeddings, a.hidden_size)
        )
        self.blocks = nn.ModuleList(VisionBlock(a) for _ in range(a.depth))
        self.merger = PatchMerger(a, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(a, postshuffle=True) for _ in a.deepstack_visual_indexes)

    def forward(self, patches: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        lengths = [t * h * w for t, h, w in grids]
        if any(t != 1 for t, _, _ in grids):
            raise ValueError("the vision tower takes images (one frame each), not videos")
        a = self.args
        dtype = self.pos_embed.weight.dtype  # the model's (a packed linear has no weight)
        x = self.patch_embed.proj(torch.cat(patches).to(dtype))
        positions = {grid: self._positions(grid[1], grid[2]) for grid in dict.fromkeys(grids)}
        x = x + torch.cat([positions[grid] for grid in grids]).to(dtype)
        cos, sin = vision_rotary(
            grids, head_dim=a.head_dim, theta=a.rope_theta, merge=a.spatial_merge_size, device=x.device
        )
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in self.args.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.args.deepstack_visual_indexes.index(i)](x))
        merged = torch.cat([self.merger(x), *deepstack], dim=-1)
        return list(merged.split([n // self.args.spatial_merge_size**2 for n in lengths]))

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """The learned square of positions resampled to h x w (bilinear, corners aligned), in float32."""
        side = round(self.args.num_position_embeddings**0.5)
        table = self.pos_embed.weight.view(side, side, -1)

        def taps(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            src = torch.arange(n, dtype=torch.float32, device=table.device) * (side - 1) / max(n - 1, 1)
            lo = src.floor().long()
            return lo, (lo + 1).clamp(max=side - 1), (src - lo)[:, None, None]

        r0, r1, fr = taps(h)
        c0, c1, fc = taps(w)
        rows = table[r0].float() * (1 - fr) + table[r1].float() * fr  # [h, side, hidden]
        grid = rows[:, c0] * (1 - fc).transpose(0, 1) + rows[:, c1] * fc.transpose(0, 1)
        return block_order(grid, self.args.spatial_merge_size)


def block_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[h, w, ...] -> [h * w, ...] listed merge x merge block by block, as the patches are."""
    h, w = grid.shape[0], grid.shape[1]
    return grid.reshape(h // merge, merge, w // merge, merge, -1).transpose(1, 2).reshape(h * w, -1)


def vision_rotary(
    grids: list[tuple[int, int, int]], *, head_dim: int, theta: float, merge: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [patches, 1, 1, head_dim] in float32 for rotate_pairs: a patch's row angles, then its column
    angles (Qwen2-VL's 2-D rotary, which every Qwen-VL tower since keeps)."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter))
    coords = []
    for _, h, w in grids:
        hw = torch.stack(
            torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"), dim=-1
        )
        coords.append(block_order(hw, merge))
    angles = (torch.cat(coords)[:, :, None].float() * inv_freq).flatten(1)  # [patches, row | column]
    cos, sin = full_width_rotary(angles[:, None])
    return cos[:, None, None], sin[:, None, None]
