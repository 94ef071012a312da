"""Mamba2's state-space rule (the SSD: state space duality) for one sequence or a batch of decode rows, in float32.

Per head h, with a state S [P, N] (head_dim x d_state), a step dt_t > 0, A_h < 0 and the head's group's B_t, C_t [N],
token t does
    S <- exp(dt_t A_h) S + dt_t x_t B_t^T;   y_t = S C_t
(the D skip and the gate are the mixer's). step_() runs it for one token of many rows (decode); chunked() runs a
prompt `chunk` tokens at a time (prefill): inside a chunk the outputs are a masked, decayed C.B "attention" over
dt x, and only the chunk-to-chunk state is carried sequentially. Both start from a sequence's state and leave the
state after its last token, so a prompt prefilled in several steps ends where one step would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_head(m: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C [..., G, N] -> [..., H, N] float32: each group serves H / G consecutive heads."""
    return m.float().repeat_interleave(num_heads // m.shape[-2], dim=-2)


def step_(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """One token of R rows: x [R, H, P]; dt [R, H] (after softplus and clamp); a [H] (A = -exp(A_log)); b, c
    [R, G, N]; states [R, H, P, N] float32, updated in place. Returns y [R, H, P] float32 (no D skip)."""
    heads = x.shape[1]
    dtf = dt.float()
    states.mul_((dtf * a.float()).exp()[..., None, None])
    states.add_((x.float() * dtf[..., None])[..., None] * _per_head(b, heads)[:, :, None, :])
    return (states @ _per_head(c, heads)[..., None]).squeeze(-1)


def recurrent(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token: x [T, H, P]; dt [T, H]; b, c [T, G, N]; state [H, P, N]. Returns (y [T, H, P]
    float32, the new state)."""
    s = state.float().clone()[None]
    out = torch.stack([step_(x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], s)[0] for t in range(len(x))])
    return out, s[0]


def chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As recurrent(), `chunk` tokens at a time."""
    length, heads = x.shape[0], x.shape[1]
    pad = -length % chunk
    # Padded tokens have dt = 0: no decay and no input, so neither the state nor the real outputs change.
    xdt = F.pad(x.float() * dt.float()[..., None], (0, 0, 0, 0, 0, pad))
    log_decay = F.pad(dt.float() * a.float(), (0, 0, 0, pad))
    bh, ch = (F.pad(_per_head(m, heads), (0, 0, 0, 0, 0, pad)) for m in (b, c))
    n = (length + pad) // chunk
    # [H, n, L, ...]: heads first, then chunks, then positions in a chunk
    xdt, bh, ch = (t.reshape(n, chunk, heads, -1).permute(2, 0, 1, 3) for t in (xdt, bh, ch))
    cum = log_decay.reshape(n, chunk, heads).permute(2, 0, 1).cumsum(-1)  # log decay from the chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    within = ((ch @ bh.transpose(-1, -2)) * pairwise) @ xdt  # [H, n, L, P]: the chunk's own tokens
    c_decayed = ch * cum.exp()[..., None]  # reads the state the chunk starts from
    x_to_end = xdt * (cum[..., -1:] - cum).exp()[..., None]  # each token's input, decayed to the chunk's end
    s = state.float()
    out = torch.empty_like(within)
    for i in range(n):
        out[:, i] = within[:, i] + c_decayed[:, i] @ s.transpose(-1, -2)
        s = s * cum[:, i, -1].exp()[:, None, None] + x_to_end[:, i].transpose(-1, -2) @ bh[:, i]
    return out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1), s
