"""The gated delta rule of Gated DeltaNet (Qwen3-Next, Qwen3.5) for one sequence, in float32, from a state.

Per head, with a state S [Dk, Dv], a decay g_t <= 0 (log space) and a learning rate beta_t in (0, 1), token t does
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
with q and k L2-normalised and q scaled by Dk^-1/2. recurrent() runs that literally (decode: one token);
chunked() runs it 64 tokens at a time (prefill): inside a chunk the sequential updates are one triangular solve
(the UT transform), and only the chunk-to-chunk scan is sequential. Both start from the state the sequence holds
and return the state after its last token, so a prompt prefilled in several steps ends where one step would.
"""

from __future__ import annotations

import torch

CHUNK = 64
L2_EPS = 1e-6
# Below this log scale a decode state's scale is folded into it (step_): S / c then stays under e^64 times S.
LOG_SCALE_FLOOR = -64.0


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] -> float32 [Hv, T, Dk], normalised, q scaled; each key head serves Hv / Hk value heads."""
    group = num_v_heads // q.shape[1]
    q, k = (x.float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))
    q, k = l2_normalise(q), l2_normalise(k)
    return q * q.shape[-1] ** -0.5, k


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] float32. Returns (o [T, Hv, Dv] in
    v's dtype, the new state)."""
    q, k = _prepare(q, k, v.shape[1])
    vf, gf, bf = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    out = torch.empty_like(vf)
    s = state.float()
    for t in range(vf.shape[1]):
        s = s * gf[:, t].exp()[:, None, None]
        k_t = k[:, t]
        delta = (vf[:, t] - torch.einsum("hkv,hk->hv", s, k_t)) * bf[:, t, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", s, q[:, t])
    return out.transpose(0, 1).to(v.dtype), s


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As recurrent(), a chunk of tokens at a time."""
    length = v.shape[0]
    q, k = _prepare(q, k, v.shape[1])
    vf, gf, bf = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    pad = -length % chunk
    if pad:  # zero keys, values and decays: padded tokens change neither the state nor the real outputs
        q, k, vf = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, vf))
        gf, bf = (torch.nn.functional.pad(x, (0, pad)) for x in (gf, bf))
    heads, n = vf.shape[0], (length + pad) // chunk
    q, k, vf = (x.reshape(heads, n, chunk, -1) for x in (q, k, vf))
    gf, bf = gf.reshape(heads, n, chunk), bf.reshape(heads, n, chunk)
    decay = gf.cumsum(-1)  # log of the decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    # pairwise[i, j] = exp(decay_i - decay_j) for j <= i: the decay between tokens j and i of a chunk
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * bf[..., None]
    # The UT transform: (I + strictly-lower(beta_i k_i.k_j pairwise_ij)) turns a chunk's sequential updates into
    # values corrected for each other (u) and the decayed keys that read the state the chunk starts from (w).
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    u = torch.linalg.solve_triangular(system, vf * bf[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    attend = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    s = state.float()
    out = torch.empty_like(vf)
    for c in range(n):
        fresh = u[:, c] - w[:, c] @ s  # what the chunk writes, less what the state already predicts
        out[:, c] = q_decayed[:, c] @ s + attend[:, c] @ fresh
        s = s * decay[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ fresh
    out = out.reshape(heads, n * chunk, -1)[:, :length]
    return out.transpose(0, 1).to(v.dtype), s


def materialise(held: torch.Tensor) -> torch.Tensor:
    """The states S [..., Hv, Dk, Dv] (a new float32 tensor) of states as slots hold them, [..., Hv, Dk + 1, Dv]:
    S / c in the first Dk rows, log c in the last row's first column (step_ says why)."""
    return held[..., :-1, :] * held[..., -1:, :1].exp()


def held_form(state: torch.Tensor) -> torch.Tensor:
    """States S [..., Hv, Dk, Dv] as slots hold them (a new tensor, c = 1)."""
    return torch.nn.functional.pad(state.float(), (0, 0, 0, 1))


def store_(held: torch.Tensor, state: torch.Tensor) -> None:
    """Writes states S [..., Hv, Dk, Dv] into held slots [..., Hv, Dk + 1, Dv], with c = 1."""
    held[..., :-1, :].copy_(state)
    held[..., -1, :].zero_()


def step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    held: torch.Tensor,
    capturable: bool = False,
) -> torch.Tensor:
    """One token of each of N heads (decode), updating their states in place: q, k [Hk, Dk]; v [Hv, Dv]; g, beta [Hv];
    held [Hv, Dk + 1, Dv] float32, each head's state S kept as S_u = S / c and log c (materialise()). Returns
    o [Hv, Dv] in v's dtype.

    Both reads of the state come from the state before the token, in one batched matmul:
        S' = e^g S + k d^T with d = beta (v - e^g S^T k),   o = S'^T q = e^g S^T q + d (k . q).
    The decay goes into the scale (c' = e^g c) and only the rank-one term into S_u (S_u += k (d / c')^T), so a token
    reads the state twice and writes it once, where scaling it in place would read it three times and write it
    twice: a CPU decode step of a large batch is bound by that traffic. Heads whose c' falls below
    e^LOG_SCALE_FLOOR fold it into S_u first, so S_u never overflows. capturable: fold with one masked pass over
    every head instead of finding the few that need it (no host sync, for a CUDA graph).
    """
    q, k = _prepare(q[None], k[None], v.shape[0])  # [Hv, 1, Dk]
    state, log_c = held[:, :-1], held[:, -1, 0]
    read = torch.bmm(torch.cat([k, q], dim=1), state)  # [Hv, 2, Dv]: S_u^T k and S_u^T q
    log_next = log_c + g.float()
    scale = log_next.exp()[:, None]  # c'
    delta = beta.float()[:, None] * (v.float() - scale * read[:, 0])
    out = scale * read[:, 1] + (k[:, 0] * q[:, 0]).sum(-1, keepdim=True) * delta
    low = log_next < LOG_SCALE_FLOOR
    if capturable:
        state.mul_(torch.where(low[:, None], scale, 1.0)[:, :, None])
    elif bool(low.any()):
        heads = low.nonzero().squeeze(1)
        state.index_copy_(0, heads, state.index_select(0, heads) * scale[heads, :, None])
    scale = torch.where(low[:, None], 1.0, scale)
    log_c.copy_(log_next.masked_fill(low, 0.0))
    # NOTE: an elementwise rank-one update: baddbmm_ falls back to one matmul per head on the strided S_u view.
    state.addcmul_(k.transpose(1, 2), (delta / scale)[:, None, :])
    return out.to(v.dtype)
