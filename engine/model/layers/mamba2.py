"""The Mamba2 mixer (Nemotron-H's `M` layers) over a step's flattened sequences and their recurrent-state slots.

in_proj -> (gate z, x|B|C, dt); a causal depthwise conv1d (window K, with bias) and SiLU over x|B|C; dt =
softplus(dt + dt_bias) clamped to time_step_limit; the SSD (engine.model.layers.ssd) with A = -exp(A_log) per head
and B, C shared by the heads of each of n_groups; + D x; RMSNorm of y * SiLU(z) over each group's channels
(transformers' MambaRMSNormGated); out_proj. Parameter names follow the hub's `mixer.*`. Falcon-H1's options: μP
multipliers on in_proj's five parts, the norm before the gate (RMSNorm(y) * SiLU(z)) or no norm at all (y * SiLU(z)).

Each sequence carries the slot contract Gated DeltaNet's does (engine/model/layers/recurrent_step.py): its conv
window [conv_dim, K - 1] in the model dtype and its SSM state [H, P, N] in float32, read from the slots a step gives
and written back, captured at page boundaries and replayed after a speculative verify, so prefix snapshots,
preemption, forks and speculative decoding need nothing of their own. On CUDA the conv runs causal_conv1d where it
runs (engine/cuda/causal_conv.py) and the SSD fla's simple-GLA kernels where fla imports (engine/cuda/ssd_scan.py);
elsewhere both run in torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.cuda import causal_conv, ssd_scan
from engine.model.layers import ssd
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.recurrent_step import RecurrentStep


@dataclass(frozen=True, kw_only=True)
class Mamba2Shape:
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj's
    out_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    rms_norm: bool = True  # False (Falcon-H1's mamba_rms_norm off): y * SiLU(z), no norm and no norm weight
    norm_before_gate: bool = False  # True: RMSNorm(y) * SiLU(z), in place of RMSNorm(y * SiLU(z))
    # Falcon-H1's μP multipliers of in_proj's z, x, B, C and dt outputs (transformers' mup_vector)
    proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's (conv window, SSM state) shapes."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)


def read_dt_limit(config: dict) -> tuple[float, float]:
    """time_step_limit as (low, high): transformers 5 writes infinity as {"__float__": "Infinity"}, the hub's configs
    as a JSON Infinity; absent, no clamp."""
    low, high = (
        float(v["__float__"]) if isinstance(v, dict) else float(v)
        for v in config.get("time_step_limit") or (0.0, math.inf)
    )
    return low, high


@dataclass(frozen=True, kw_only=True)
class GroupSplit:
    """A tensor-parallel shard with more ranks than groups holds part of one group's heads: that group's index among
    the model's `groups` and its whole width, over which the gated norm's mean is summed across the ranks."""

    tp: TensorParallel
    group: int
    groups: int
    width: int


class GroupGatedRMSNorm(nn.Module):
    """RMSNorm of x * SiLU(gate) over each of `groups` equal parts of the channels, in float32, as transformers'
    MambaRMSNormGated; norm_before_gate: RMSNorm(x) * SiLU(gate) (Falcon-H1's FalconH1RMSNormGated); with a
    `split`, over one group shared with other ranks."""

    def __init__(
        self, *, dim: int, groups: int, eps: float, norm_before_gate: bool = False, split: GroupSplit | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.norm_before_gate, self.split = groups, eps, norm_before_gate, split

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g = F.silu(gate.float())
        h = x.float() if self.norm_before_gate else x.float() * g
        if self.split is None:
            h = h.unflatten(-1, (self.groups, -1))
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        else:  # each rank adds its channels' squares to its group's column: every rank gets its group's sum
            s = self.split
            sums = h.new_zeros(h.shape[0], s.groups)
            sums[:, s.group] = h.pow(2).sum(-1)
            sums = s.tp.all_reduce(sums)
            h = h * torch.rsqrt(sums[:, s.group : s.group + 1] / s.width + self.eps)
        h = self.weight.float() * h
        return (h * g if self.norm_before_gate else h).to(gate.dtype)


class Mamba2Mixer(nn.Module):
    """The mixer of one Mamba2 layer; forward reads and writes the sequences' state slots."""

    def __init__(self, shape: Mamba2Shape, split: GroupSplit | None = None) -> None:
        """split: a shard's part of one group shared with other ranks (engine/model/sharding.py)."""
        super().__init__()
        self.shape = s = shape
        self.in_proj = nn.Linear(s.hidden_size, s.inner + s.conv_dim + s.num_heads, bias=s.proj_bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm = (
            GroupGatedRMSNorm(
                dim=s.inner, groups=s.n_groups, eps=s.eps, norm_before_gate=s.norm_before_gate, split=split
            )
            if s.rms_norm
            else None
        )
        self.out_proj = nn.Linear(s.inner, s.hidden_size, bias=s.out_bias)

    def forward(
        self, x: torch.Tensor, step: RecurrentStep, conv_pool: torch.Tensor, state_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, hidden]: the step's sequences one after another (step.spans); conv_pool [slots, conv_dim, K - 1]
        and state_pool [slots, H, P, N] are this layer's state slots, read and written at step.slots."""
        s = self.shape
        z, xbc, dt = self._project(x)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*s.dt_limit)
        y = step.run(
            decode=lambda rows, index, _: self._decode(xbc[rows], dt[rows], index, conv_pool, state_pool),
            prefill=lambda rows, slot, capture, write: self._prefill(
                xbc[rows], dt[rows], slot, capture, conv_pool, state_pool, write=write
            ),
            empty=lambda: torch.empty(x.shape[0], s.num_heads, s.head_dim, dtype=torch.float32, device=x.device),
            pools=(conv_pool, state_pool),
        )
        return self.out_proj(self._gate(y.flatten(1), z))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj's gate z, conv input x|B|C and dt, each part under its multiplier (Falcon-H1's μP)."""
        s = self.shape
        z, xbc, dt = self.in_proj(x).split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        if s.proj_multipliers == (1.0, 1.0, 1.0, 1.0, 1.0):
            return z, xbc, dt
        mz, mx, mb, mc, mdt = s.proj_multipliers
        xs, b, c = xbc.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        return z * mz, torch.cat([xs * mx, b * mb, c * mc], dim=-1), dt * mdt

    def _gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The scan's output y [T, inner] (float32) gated by SiLU(z), through the gated norm where there is one."""
        if self.norm is None:
            return (y * F.silu(z.float())).to(z.dtype)
        return self.norm(y, z)

    def _fused_conv(self, x: torch.Tensor, conv_pool: torch.Tensor) -> bool:
        s = self.shape
        return (
            causal_conv.runs(x.device)
            and causal_conv.supports(s.conv_dim, s.conv_kernel)
            and conv_pool.dtype == x.dtype
        )

    def _ssm_inputs(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H, P], B and C [T, G, N] of the conv's output."""
        s, t = self.shape, xbc.shape[0]
        xs, b, c = xbc.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        return xs.reshape(t, s.num_heads, s.head_dim), b.reshape(t, s.n_groups, -1), c.reshape(t, s.n_groups, -1)

    def _skip(self, y: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return y + xs.float() * self.D.float()[:, None]

    def _decode(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        index: torch.Tensor,
        conv_pool: torch.Tensor,
        state_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token of each of R sequences, their states at `index` (a long tensor on the device): gathered, stepped
        and scattered back, with no host sync (a CUDA graph captures it). Returns y [R, H, P] float32."""
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        if self._fused_conv(xbc, conv_pool):
            xbc = causal_conv.update(xbc, conv_pool, weight, index, bias=bias)
        else:  # the conv as a dot product of each window (its last K - 1 inputs, then this token) with the kernel
            window = torch.cat([conv_pool.index_select(0, index).to(xbc.dtype), xbc[:, :, None]], dim=2)
            conv_pool.index_copy_(0, index, window[:, :, 1:].to(conv_pool.dtype))
            out = (window * weight).sum(-1)
            xbc = F.silu(out if bias is None else out + bias)
        xs, b, c = self._ssm_inputs(xbc)
        a, states = -self.A_log.float().exp(), state_pool.index_select(0, index)
        if ssd_scan.fla_runs(xbc.device):  # NOTE: two copies of the rows' states at once, as in the torch step
            y, states = ssd_scan.step(xs, dt, a, b, c, states)
        else:
            y = ssd.step_(xs, dt, a, b, c, states)
        state_pool.index_copy_(0, index, states)
        return self._skip(y, xs)

    def _prefill(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        slot: int,
        capture: tuple[int, int] | None,
        conv_pool: torch.Tensor,
        state_pool: torch.Tensor,
        write: bool = True,
    ) -> torch.Tensor:
        """One sequence's rows from its state in `slot`, chunked; capture (rows, dst): dst gets the state after
        that many rows (the scan then runs in two parts, from the state between them). write False: the slot keeps
        the state it had. Returns y [T, H, P] float32."""
        s, length = self.shape, xbc.shape[0]
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        # The conv sees the sequence's last K - 1 inputs before this step, then this step's.
        window = torch.cat([conv_pool[slot].to(xbc.dtype), xbc.t()], dim=1)
        if self._fused_conv(xbc, conv_pool):
            conv = causal_conv.prefill(xbc, conv_pool[slot], weight, bias=bias)
        else:
            conv = F.silu(F.conv1d(window[None], self.conv1d.weight, bias, groups=s.conv_dim)[0]).t()
        xs, b, c = self._ssm_inputs(conv)
        a = -self.A_log.float().exp()
        cut = capture[0] if capture is not None else length
        parts = [(0, cut), (cut, length)] if cut < length else [(0, length)]
        state, outs = state_pool[slot].float(), []
        fla = ssd_scan.fla_runs(xbc.device)
        for lo, hi in parts:
            if fla:
                y, state = ssd_scan.chunked(xs[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], state)
            else:
                y, state = ssd.chunked(xs[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], state, s.chunk_size)
            outs.append(y)
            if capture is not None and hi == cut:
                conv_pool[capture[1]].copy_(window[:, cut : cut + s.conv_kernel - 1])
                state_pool[capture[1]].copy_(state)
        if write:
            conv_pool[slot].copy_(window[:, -(s.conv_kernel - 1) :])
            state_pool[slot].copy_(state)
        return self._skip(torch.cat(outs) if len(outs) > 1 else outs[0], xs)
