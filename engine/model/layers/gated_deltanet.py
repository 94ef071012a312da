"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, over a step's flattened sequences.

in_proj_qkv, a causal depthwise conv1d (window K) with SiLU over q|k|v, the gated delta rule (engine.model.layers.
delta_rule) with beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias), an RMSNorm gated by SiLU(z) per
value head, out_proj. Parameter names follow the hub's `linear_attn.*`.

Each sequence carries a fixed-size state instead of pages: its conv window (the last K - 1 inputs of the conv,
[conv_dim, K - 1]) and its delta-rule state ([Hv, Dk + 1, Dv], float32: S / c and log c, as delta_rule.step_ keeps
it). forward() reads them from the slots it is given and writes them back, so a prompt prefilled in chunks, or
decoded token by token, ends in the state that one pass would leave.

Decode has two paths that give the same numbers (tests/engine/model/test_gated_deltanet.py): on the CPU, the rule
runs in place over the pool's slots, steered by the slots as Python ints; on CUDA, and in any step a CUDA graph
replays, it reads the slots only as a tensor (RecurrentStep.slot_index) and gathers, steps and scatters the states,
through fla's fused recurrent kernel and causal_conv1d's conv update where they run (engine/cuda/linear_attention.py,
engine/cuda/causal_conv.py), so that the step can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.cuda import causal_conv, linear_attention
from engine.model.layers import delta_rule
from engine.model.layers.recurrent_step import RecurrentStep


@dataclass(frozen=True, kw_only=True)
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
        """One sequence's (conv window, delta-rule state as a slot holds it: delta_rule.materialise) shapes."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim + 1, self.head_v_dim)


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


class DeltaNetCore(nn.Module):
    """Gated DeltaNet from its projected inputs on: the conv, the gated delta rule, the gated norm and out_proj. A
    subclass adds its input projections and `project` (GatedDeltaNet below: Qwen3.5's layout)."""

    def __init__(self, shape: DeltaNetShape) -> None:
        super().__init__()
        self.shape = s = shape
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.head_v_dim, s.eps)
        self.out_proj = nn.Linear(s.num_v_heads * s.head_v_dim, s.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, step: RecurrentStep, conv_pool: torch.Tensor, state_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, hidden]: the step's sequences one after another (step.spans); conv_pool [slots, conv_dim, K - 1]
        and state_pool [slots, Hv, Dk + 1, Dv] are this layer's state slots, read and written at step.slots."""
        s = self.shape
        mixed, z, b, a = self.project(x)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        # NOTE: only the CPU path reads the slots as Python ints; on CUDA, and in a step a CUDA graph replays, decode
        # reads slot_index alone (no host sync, no value-dependent shape or branch).
        cpu = x.device.type == "cpu"
        out = step.run(
            decode=lambda rows, index, slots: self._decode(
                mixed[rows], g[rows], beta[rows], index, conv_pool, state_pool, slots if cpu else None
            ),
            prefill=lambda rows, slot, capture, write: self._prefill(
                mixed[rows], g[rows], beta[rows], slot, capture, conv_pool, state_pool, write=write
            ),
            empty=lambda: torch.empty(x.shape[0], s.num_v_heads, s.head_v_dim, dtype=x.dtype, device=x.device),
            pools=(conv_pool, state_pool),
        )
        gated = self.norm(out.reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim))
        return self.out_proj(gated.reshape(x.shape[0], -1))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q|k|v before the conv, z, b, a), each [tokens, ...] flat per head."""
        raise NotImplementedError

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, t = self.shape, qkv.shape[0]
        key_dim = s.num_k_heads * s.head_k_dim
        return (
            qkv[:, :key_dim].reshape(t, s.num_k_heads, s.head_k_dim),
            qkv[:, key_dim : 2 * key_dim].reshape(t, s.num_k_heads, s.head_k_dim),
            qkv[:, 2 * key_dim :].reshape(t, s.num_v_heads, s.head_v_dim),
        )

    def _fused_conv(self, x: torch.Tensor, conv_pool: torch.Tensor) -> bool:
        s = self.shape
        return (
            causal_conv.runs(x.device)
            and causal_conv.supports(s.conv_dim, s.conv_kernel)
            and conv_pool.dtype == x.dtype
        )

    def _decode(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        index: torch.Tensor,
        conv_pool: torch.Tensor,
        state_pool: torch.Tensor,
        cpu_slots: list[int] | None,
    ) -> torch.Tensor:
        """One token of each of B sequences (rows of mixed), their states at `index` (a long tensor on the device).
        cpu_slots: the same slots as Python ints, for the CPU's in-place rule (_rule_in_place); None: the
        capture-safe path, which gathers the rows' states, steps them (fla's fused kernel where it runs) and
        scatters them back, all through `index`."""
        if self._fused_conv(mixed, conv_pool):
            qkv = causal_conv.update(mixed, conv_pool, self.conv1d.weight[:, 0], index)
        else:  # the conv as a dot product of each window (its last K - 1 inputs, then this token) with the kernel
            window = torch.cat([conv_pool.index_select(0, index).to(mixed.dtype), mixed[:, :, None]], dim=2)
            conv_pool.index_copy_(0, index, window[:, :, 1:].to(conv_pool.dtype))
            qkv = F.silu((window * self.conv1d.weight[:, 0]).sum(-1))  # [B, conv_dim]
        q, k, v = self._split(qkv)
        if cpu_slots is not None:
            return self._rule_in_place(q, k, v, g, beta, cpu_slots, index, state_pool)
        if linear_attention.fla_runs(mixed.device):  # NOTE: two copies of the rows' states live at once at most
            o, stepped = linear_attention.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, delta_rule.materialise(state_pool.index_select(0, index))
            )
            states = delta_rule.held_form(stepped)
        else:
            states = state_pool.index_select(0, index)
            o = self._step(q, k, v, g, beta, states, capturable=True)
        state_pool.index_copy_(0, index, states)
        return o

    def _step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        capturable: bool = False,
    ) -> torch.Tensor:
        """The torch rule's one token for B rows (states [B, Hv, Dk + 1, Dv], updated in place); o [B, Hv, Dv]."""
        s = self.shape
        return delta_rule.step_(
            q.flatten(0, 1),
            k.flatten(0, 1),
            v.flatten(0, 1),
            g.flatten(),
            beta.flatten(),
            states.view(-1, s.head_k_dim + 1, s.head_v_dim),
            capturable,
        ).view(-1, s.num_v_heads, s.head_v_dim)

    def _rule_in_place(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        slots: list[int],
        index: torch.Tensor,
        state_pool: torch.Tensor,
    ) -> torch.Tensor:
        """The CPU's decode rule: over the B sequences' heads at once, in place on the pool's slots lo..hi when they
        span few more than B (idle slots in between get a zero key and no decay, which leaves their state exactly
        as it was), on gathered copies otherwise. Gathering and scattering float32 states dominated a CPU step
        (bench/RESULTS.md, "Hybrid Qwen3.5"); the min / max of Python slots is what a CUDA graph cannot replay."""
        b = q.shape[0]
        lo, hi = min(slots), max(slots) + 1
        in_place, in_order = hi - lo <= 2 * b, slots == list(range(lo, hi))
        if in_place and not in_order:  # rows in slot order, idle slots between them zero
            q, k, v, g, beta = (
                torch.zeros((hi - lo, *x.shape[1:]), dtype=x.dtype, device=x.device).index_copy_(0, index - lo, x)
                for x in (q, k, v, g, beta)
            )
        states = state_pool[lo:hi] if in_place else state_pool.index_select(0, index)
        o = self._step(q, k, v, g, beta, states)
        if not in_place:
            state_pool.index_copy_(0, index, states)
        return o.index_select(0, index - lo) if in_place and not in_order else o

    def _prefill(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        slot: int,
        capture: tuple[int, int] | None,
        conv_pool: torch.Tensor,
        state_pool: torch.Tensor,
        write: bool = True,
    ) -> torch.Tensor:
        """One sequence's rows from its state in `slot`, chunked; capture (rows, dst): dst gets the state after
        that many rows (the rule then runs in two parts, from the state between them). write False: the slot keeps
        the state it had."""
        s, length = self.shape, mixed.shape[0]
        # The conv sees the sequence's last K - 1 inputs before this step, then this step's.
        window = torch.cat([conv_pool[slot].to(mixed.dtype), mixed.t()], dim=1)
        if self._fused_conv(mixed, conv_pool):
            qkv = causal_conv.prefill(mixed, conv_pool[slot], self.conv1d.weight[:, 0])
        else:
            qkv = F.silu(F.conv1d(window[None], self.conv1d.weight, groups=s.conv_dim)[0]).t()  # [length, conv_dim]
        q, k, v = self._split(qkv)
        cut = capture[0] if capture is not None else length
        parts = [(0, cut), (cut, length)] if cut < length else [(0, length)]
        state, outs = delta_rule.materialise(state_pool[slot]), []
        fla = linear_attention.fla_runs(mixed.device)
        rule = linear_attention.chunk_gated_delta_rule if fla else delta_rule.chunked
        for lo, hi in parts:
            o, state = rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
            outs.append(o)
            if capture is not None and hi == cut:
                conv_pool[capture[1]].copy_(window[:, cut : cut + s.conv_kernel - 1])
                delta_rule.store_(state_pool[capture[1]], state)
        if write:
            conv_pool[slot].copy_(window[:, -(s.conv_kernel - 1) :])
            delta_rule.store_(state_pool[slot], state)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class GatedDeltaNet(DeltaNetCore):
    """Qwen3.5's Gated DeltaNet: q|k|v, z, b and a each from a projection of its own."""

    def __init__(self, shape: DeltaNetShape) -> None:
        super().__init__(shape)
        s = shape
        key_dim, value_dim = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim
        self.in_proj_qkv = nn.Linear(s.hidden_size, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
