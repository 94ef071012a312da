"""Gemma 4's vision tower and its embedder (transformers' Gemma4VisionModel and Gemma4MultimodalEmbedder). Unlike
Gemma 3's SigLIP it takes an image of any size: its patches (engine/image/gemma4.py) through one matrix (pixels
mapped from [0, 1] to [-1, 1] first), plus a learned row and a learned column embedding; blocks of Gemma 4's own
shape (RMSNorms scaling by w before and after attention and the MLP, q / k norms and a weightless v norm, attention
scale 1, GQA, 2-D rotary: the first half of each head turned by the patch's column, the second by its row) with full
attention within the image; each k x k block of patches averaged to one soft token (row by row), times
sqrt(hidden) in float32, optionally standardised by the checkpoint's std_bias / std_scale. The embedder: a
weightless RMSNorm and one matrix into the text width. Parameter names are the hub's (model.vision_tower.*,
model.embed_vision.*)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.linear_post import linear_gelu, linear_mul
from engine.model.layers.norm import GemmaRMSNorm
from engine.model.layers.rotary import full_width_rotary, rotate_pairs
from engine.model.vision.attention import image_attention


@dataclass(frozen=True, kw_only=True)
class Gemma4VisionArgs:
    """vision_config's fields (transformers' Gemma4VisionConfig defaults where it is silent)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0

    @classmethod
    def from_config(cls, raw: dict) -> Gemma4VisionArgs:
        act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        rope = raw.get("rope_parameters") or {}
        if act not in ("gelu_pytorch_tanh", "gelu_tanh") or rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModel(
                f"vision_config: hidden_activation {act!r} / rope_type {rope.get('rope_type')!r} "
                "is not supported (gelu_pytorch_tanh, axial)",
                param="model",
            )
        if raw.get("attention_bias"):
            raise UnsupportedModel("vision_config.attention_bias is not supported for Gemma 4", param="model")
        names = [f for f in cls.__dataclass_fields__ if f != "rope_theta"]
        args = cls(
            **{k: raw[k] for k in names if raw.get(k) is not None}, rope_theta=float(rope.get("rope_theta") or 100.0)
        )
        if args.head_dim % 4 or args.num_attention_heads % args.num_key_value_heads:
            raise UnsupportedModel(
                "vision_config: head_dim must be a multiple of 4 and num_attention_heads of num_key_value_heads",
                param="model",
            )
        return args


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output may be clamped to the checkpoint's bounds (use_clipped_linears)."""

    def __init__(self, a: Gemma4VisionArgs, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.clipped = a.use_clipped_linears
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, nn.Parameter(torch.empty(())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        return torch.clamp(
            self.linear(torch.clamp(x, self.input_min, self.input_max)), self.output_min, self.output_max
        )

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(self(x)), fused into the matmul where nothing is clipped between them."""
        return F.gelu(self(x), approximate="tanh") if self.clipped else linear_gelu(self.linear, x, "tanh")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """self(x) * other, fused into the matmul where nothing is clipped between them."""
        return self(x) * other if self.clipped else linear_mul(self.linear, x, other)


class VisionAttention(nn.Module):
    def __init__(self, a: Gemma4VisionArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = ClippableLinear(a, a.hidden_size, a.num_attention_heads * a.head_dim)
        self.k_proj = ClippableLinear(a, a.hidden_size, a.num_key_value_heads * a.head_dim)
        self.v_proj = ClippableLinear(a, a.hidden_size, a.num_key_value_heads * a.head_dim)
        self.o_proj = ClippableLinear(a, a.num_attention_heads * a.head_dim, a.hidden_size)
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, unit_offset=False)
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, unit_offset=False)
        self.v_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, scaled=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q = self._rotate(self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)), cos, sin)
        k = self._rotate(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(n, self.kv_heads, self.head_dim))
        return self.o_proj(image_attention(q, k, v, lengths, scale=1.0).reshape(n, -1))

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The head's first half turned by the columns' angles, its second by the rows' (cos, sin [T, 1, d])."""
        return rotate_pairs(x, cos, sin, pieces=2)


class VisionMLP(nn.Module):
    def __init__(self, a: Gemma4VisionArgs) -> None:
        super().__init__()
        self.gate_proj = ClippableLinear(a, a.hidden_size, a.intermediate_size)
        self.up_proj = ClippableLinear(a, a.hidden_size, a.intermediate_size)
        self.down_proj = ClippableLinear(a, a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj.mul(x, self.gate_proj.gelu(x)))


class VisionLayer(nn.Module):
    def __init__(self, a: Gemma4VisionArgs) -> None:
        super().__init__()
        self.self_attn = VisionAttention(a)
        self.mlp = VisionMLP(a)
        norm = [GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, unit_offset=False) for _ in range(4)]
        (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        ) = norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, lengths))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, a: Gemma4VisionArgs) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * a.patch_size**2, a.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.empty(2, a.position_embedding_size, a.hidden_size))

    def forward(self, patches: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # (the table's dtype is the model's: on a bf16 CPU the linear is a packed one with no .weight)
        h = self.input_proj((2 * (patches - 0.5)).to(self.position_embedding_table.dtype))
        return h + self.position_embedding_table[0][cols] + self.position_embedding_table[1][rows]


class VisionEncoder(nn.Module):
    def __init__(self, a: Gemma4VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(a) for _ in range(a.num_hidden_layers))


class Gemma4VisionTower(nn.Module):
    """Images' patches and grids (rows, columns) -> per image [(rows / k) * (columns / k), hidden] soft tokens."""

    def __init__(self, a: Gemma4VisionArgs) -> None:
        super().__init__()
        self.args = a
        self.patch_embedder = PatchEmbedder(a)
        self.encoder = VisionEncoder(a)
        if a.standardize:
            self.std_bias = nn.Parameter(torch.empty(a.hidden_size))
            self.std_scale = nn.Parameter(torch.empty(a.hidden_size))

    def forward(self, patches: list[torch.Tensor], grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        a = self.args
        k = a.pooling_kernel_size
        if any(r % k or c % k for r, c in grids):
            raise ValueError(f"an image's patch grid must be whole {k}x{k} blocks, got {grids}")
        device = patches[0].device
        coords = [
            torch.meshgrid(torch.arange(r, device=device), torch.arange(c, device=device), indexing="ij")
            for r, c in grids
        ]
        rows = torch.cat([r.flatten() for r, _ in coords])
        cols = torch.cat([c.flatten() for _, c in coords])
        x = self.patch_embedder(torch.cat(patches), cols, rows)
        cos, sin = self.rotary(cols, rows, x.dtype)
        lengths = [r * c for r, c in grids]
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, lengths)
        out = []
        for h, (r, c) in zip(x.split(lengths), grids, strict=True):
            pooled = h.float().view(r // k, k, c // k, k, -1).mean(dim=(1, 3)).flatten(0, 1).to(x.dtype)
            pooled = pooled.float() * a.hidden_size**0.5  # float32: the scale can pass float16's range
            if a.standardize:
                pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
            out.append(pooled.to(x.dtype))
        return out

    def rotary(self, cols: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] in `dtype` for rotate_pairs: the columns' angles, then the rows'."""
        d = self.args.head_dim
        inv_freq = 1.0 / (
            self.args.rope_theta ** (torch.arange(0, d // 2, 2, dtype=torch.float32, device=cols.device) / (d // 2))
        )
        angles = torch.stack([cols, rows], dim=1).float()[..., None] * inv_freq  # [T, 2, d/4]
        return tuple(t[:, None].to(dtype) for t in full_width_rotary(angles))


class Gemma4VisionEmbedder(nn.Module):
    """Soft tokens [n, vision hidden] -> [n, text hidden]: a weightless RMSNorm, then one matrix."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = GemmaRMSNorm(vision_hidden, eps, scaled=False)
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))
