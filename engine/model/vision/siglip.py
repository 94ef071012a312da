"""SigLIP's vision transformer as Gemma 3 runs it (transformers' SiglipVisionModel without its pooling head, which
Gemma 3 does not use): a patch convolution plus learned positions, pre-norm encoder blocks (LayerNorm, multi-head
attention with biases, LayerNorm, a tanh-GeLU MLP) and a final LayerNorm. Every patch attends to every patch of
its image, so a batch of images is one batched call. Parameter names are the hub's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.layers.linear import FusedLinear, PatchKernelLinear
from engine.model.layers.linear_post import linear_add, linear_gelu

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True, kw_only=True)
class SiglipArgs:
    """vision_config's fields (transformers' SiglipVisionConfig defaults where it is silent)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_config(cls, raw: dict) -> SiglipArgs:
        act = raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise UnsupportedModel(
                f"vision_config.hidden_act {act!r} is not supported (gelu_pytorch_tanh)", param="model"
            )
        names = {
            "hidden_size": "hidden_size",
            "intermediate_size": "intermediate_size",
            "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads",
            "num_channels": "num_channels",
            "image_size": "image_size",
            "patch_size": "patch_size",
            "layer_norm_eps": "layer_norm_eps",
        }
        args = cls(**{ours: raw[theirs] for ours, theirs in names.items() if raw.get(theirs) is not None})
        if args.hidden_size % args.num_heads or args.image_size % args.patch_size:
            raise UnsupportedModel(
                "vision_config: hidden_size must divide by num_attention_heads and image_size by patch_size",
                param="model",
            )
        return args

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipAttention(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        h = a.hidden_size
        self.num_heads, self.head_dim = a.num_heads, h // a.num_heads
        self.qkv_proj = FusedLinear(h, {"q_proj": h, "k_proj": h, "v_proj": h}, True)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, b: int, n: int, residual: torch.Tensor) -> torch.Tensor:
        """residual + attention(x); x: [b * n, hidden] (2-D, as the packed CPU linears take it), n patches per
        image."""
        h = x.shape[-1]
        q, k, v = self.qkv_proj(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # no mask: all patches of an image see each other
        return linear_add(self.out_proj, out.transpose(1, 2).reshape(b * n, h), residual)


class SiglipMLP(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return linear_add(self.fc2, linear_gelu(self.fc1, x, "tanh"), residual)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.self_attn = SiglipAttention(a)
        self.layer_norm2 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.mlp = SiglipMLP(a)

    def forward(self, x: torch.Tensor, b: int, n: int) -> torch.Tensor:
        x = self.self_attn(self.layer_norm1(x), b, n, residual=x)
        return self.mlp(self.layer_norm2(x), residual=x)


class SiglipEncoder(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(a) for _ in range(a.num_layers))


class SiglipEmbeddings(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.patch_size, self.side = a.patch_size, a.patches_per_side
        self.patch_embedding = PatchKernelLinear(a.num_channels, a.hidden_size, (a.patch_size, a.patch_size))
        self.position_embedding = nn.Embedding(a.patches_per_side**2, a.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, channels, size, size] -> [B * patches, hidden], the patches row by row."""
        b, c, p, s = pixels.shape[0], pixels.shape[1], self.patch_size, self.side
        patches = pixels.reshape(b, c, s, p, s, p).permute(0, 2, 4, 1, 3, 5).reshape(b * s * s, c * p * p)
        weight = self.position_embedding.weight  # the model's dtype (a packed linear has no weight)
        h = self.patch_embedding(patches.to(weight.dtype)).view(b, s * s, -1).add_(weight)
        return h.view(b * s * s, -1)


class SiglipVisionTower(nn.Module):
    """[images, channels, image_size, image_size] pixels -> [images, patches, hidden] features."""

    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.args = a
        self.embeddings = SiglipEmbeddings(a)
        self.encoder = SiglipEncoder(a)
        self.post_layernorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.args.image_size
        if pixels.shape[1:] != (self.args.num_channels, size, size):
            raise ValueError(f"the vision tower takes images of {size}x{size}, got {tuple(pixels.shape[1:])}")
        h = self.embeddings(pixels)
        b, n, width = pixels.shape[0], self.args.patches_per_side**2, self.args.hidden_size
        for layer in self.encoder.layers:
            h = layer(h, b, n)
        return self.post_layernorm(h).view(b, n, width)
