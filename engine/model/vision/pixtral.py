"""Pixtral's vision tower (transformers' PixtralVisionModel) as Mistral 3 uses it: an image of any size whose sides
are multiples of the patch, cut by a bias-free Conv2d into patch_size^2 patches, an RMSNorm (ln_pre), then blocks
of RMSNorm (eps 1e-5), attention with a 2-D rotary (each head's angles: its row times the even frequencies, its
column times the odd ones, rotate_half style), a gated MLP; full attention within each image, none across. The
features after `vision_feature_layer` blocks go to the projector (pixtral_projector.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import full_width_rotary, rotate_pairs
from engine.model.vision.attention import image_attention

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
NORM_EPS = 1e-5  # transformers' PixtralAttentionLayer and ln_pre, whatever the config says


@dataclass(frozen=True, kw_only=True)
class PixtralVisionArgs:
    """vision_config's fields (transformers' PixtralVisionConfig defaults where it is silent)."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    hidden_act: str = "gelu"
    rope_theta: float = 10_000.0

    @classmethod
    def from_config(cls, raw: dict) -> PixtralVisionArgs:
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise UnsupportedModel(f"vision_config: rope_type {rope.get('rope_type')!r} is not axial", param="model")
        names = [f for f in cls.__dataclass_fields__ if f != "rope_theta"]
        theta = rope.get("rope_theta") or raw.get("rope_theta") or 10_000.0
        args = cls(**{k: raw[k] for k in names if raw.get(k) is not None}, rope_theta=float(theta))
        if args.hidden_act not in ACTIVATIONS:
            raise UnsupportedModel(
                f"vision_config.hidden_act {args.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})",
                param="model",
            )
        if args.hidden_size % (4 * args.num_attention_heads):
            raise UnsupportedModel("vision_config: head_dim must be a multiple of 4", param="model")
        return args

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class PixtralAttention(nn.Module):
    def __init__(self, a: PixtralVisionArgs) -> None:
        super().__init__()
        self.heads, self.head_dim = a.num_attention_heads, a.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(a.hidden_size, a.hidden_size, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q = rotate_pairs(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = rotate_pairs(self.k_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.heads, self.head_dim)
        return self.o_proj(image_attention(q, k, v, lengths).reshape(n, -1))


class PixtralMLP(nn.Module):
    def __init__(self, a: PixtralVisionArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.act = ACTIVATIONS[a.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, a: PixtralVisionArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(a.hidden_size, NORM_EPS)
        self.attention = PixtralAttention(a)
        self.ffn_norm = RMSNorm(a.hidden_size, NORM_EPS)
        self.feed_forward = PixtralMLP(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, a: PixtralVisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(a) for _ in range(a.num_hidden_layers))


class PixtralVisionTower(nn.Module):
    """Images [3, height, width] -> per image [rows * columns, hidden]: the patches' features after the first
    `feature_layer` blocks (transformers' hidden_states[vision_feature_layer]; the later blocks are not run)."""

    def __init__(self, a: PixtralVisionArgs, feature_layer: int) -> None:
        super().__init__()
        self.args = a
        self.feature_layer = feature_layer % (a.num_hidden_layers + 1)
        self.patch_conv = nn.Conv2d(a.num_channels, a.hidden_size, a.patch_size, a.patch_size, bias=False)
        self.ln_pre = RMSNorm(a.hidden_size, NORM_EPS)
        self.transformer = PixtralTransformer(a)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        p = self.args.patch_size
        grids = [(image.shape[-2] // p, image.shape[-1] // p) for image in images]
        weight = self.ln_pre.weight
        x = torch.cat([self.patch_conv(image[None].to(weight.dtype))[0].flatten(1).T for image in images])
        x = self.ln_pre(x)
        cos, sin = (t.to(x.dtype) for t in self.rotary(grids, x.device))
        lengths = [r * c for r, c in grids]
        for layer in self.transformer.layers[: self.feature_layer]:
            x = layer(x, cos, sin, lengths)
        return list(x.split(lengths))

    def rotary(self, grids: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in float32 for rotate_pairs: the rows' angles by the even frequencies, then the
        columns' by the odd ones (transformers' PixtralVisionRotaryEmbedding)."""
        d = self.args.head_dim
        inv_freq = 1.0 / (self.args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        coords = [
            torch.meshgrid(torch.arange(r, device=device), torch.arange(c, device=device), indexing="ij")
            for r, c in grids
        ]
        rows = torch.cat([r.flatten() for r, _ in coords]).float()
        cols = torch.cat([c.flatten() for _, c in coords]).float()
        angles = torch.cat([rows[:, None] * inv_freq[0::2], cols[:, None] * inv_freq[1::2]], dim=-1)  # [T, d/2]
        cos, sin = full_width_rotary(angles[:, None])  # [T, d]
        return cos[:, None], sin[:, None]
