"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, over a step's flattened sequences.

in_proj_qkv, a causal depthwise conv1d (window K) with SiLU over q|k|v, the gated delta rule (engine.model.layers.
delta_rule) with beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias), an RMSNorm gated by SiLU(z) per
value head, out_proj. Parameter names follow the hub's `linear_attn.*`.

Each sequence carries a fixed-size state instead of pages: its conv window (the last K - 1 inputs of the conv,
[conv_dim, K - 1]) and its delta-rule state ([Hv, Dk, Dv], float32). forward() reads them from the slots it is
given and writes them back, so a prompt prefilled in chunks, or decoded token by token, ends in the state that one
pass would leave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers import delta_rule


@dataclass(frozen=True)
class DeltaNetShape:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's (conv window, delta-rule state) shapes."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times SiLU(gate), as transformers' Qwen3_5RMSNormGated."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: DeltaNetShape) -> None:
        super().__init__()
        self.shape = s = shape
        key_dim, value_dim = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim
        self.in_proj_qkv = nn.Linear(s.hidden_size, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.head_v_dim, s.eps)
        self.out_proj = nn.Linear(value_dim, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]], conv_states: torch.Tensor,
                delta_states: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]: the step's sequences one after another, sequence i at rows spans[i] = (start,
        length); conv_states [i] and delta_states [i] are its state, updated in place."""
        s = self.shape
        key_dim = s.num_k_heads * s.head_k_dim
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        out = torch.empty(x.shape[0], s.num_v_heads, s.head_v_dim, dtype=x.dtype, device=x.device)
        weight = self.conv1d.weight  # [conv_dim, 1, K]
        for i, (start, length) in enumerate(spans):
            rows = slice(start, start + length)
            # The conv sees the sequence's last K - 1 inputs before this step, then this step's.
            window = torch.cat([conv_states[i].to(mixed.dtype), mixed[rows].t()], dim=1)
            conv_states[i].copy_(window[:, -(s.conv_kernel - 1):])
            qkv = F.silu(F.conv1d(window[None], weight, groups=s.conv_dim)[0]).t()  # [length, conv_dim]
            q = qkv[:, :key_dim].reshape(length, s.num_k_heads, s.head_k_dim)
            k = qkv[:, key_dim : 2 * key_dim].reshape(length, s.num_k_heads, s.head_k_dim)
            v = qkv[:, 2 * key_dim :].reshape(length, s.num_v_heads, s.head_v_dim)
            rule = delta_rule.recurrent if length == 1 else delta_rule.chunked
            o, state = rule(q, k, v, g[rows], beta[rows], delta_states[i])
            delta_states[i].copy_(state)
            out[rows] = o
        gated = self.norm(out.reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim))
        return self.out_proj(gated.reshape(x.shape[0], -1))
