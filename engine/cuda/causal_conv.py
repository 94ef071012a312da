"""The recurrent layers' causal depthwise conv (Gated DeltaNet's; Mamba2's, with a bias) on CUDA through the
optional `causal_conv1d` package (Dao-AILab's CUDA kernels): causal_conv1d_update for decode, in place on the pool's
slots through conv_state_indices, and causal_conv1d_fn for prefill, from a sequence's conv window. It is not in the
requirements (its PyPI release is source-only and builds with nvcc); where it does not import, lacks
conv_state_indices, or gives other numbers than torch on the GPU at hand (probed once per device), the layer's torch
conv runs instead, which is capture-safe too.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The kernels' limits: a window of 2 to 4, and (channel-last prefill) channels in multiples of 8.
MIN_WIDTH, MAX_WIDTH, CHANNEL_MULTIPLE = 2, 4, 8


def supports(dim: int, width: int) -> bool:
    """Whether a conv of `dim` channels and window `width` fits the kernels."""
    return MIN_WIDTH <= width <= MAX_WIDTH and dim % CHANNEL_MULTIPLE == 0


def runs(device: torch.device) -> bool:
    """Whether a recurrent layer's conv on `device` goes through causal_conv1d."""
    return device.type == "cuda" and probe_error(_index(device)) is None


def describe(device: torch.device) -> str:
    """For the start-up log: which conv a hybrid model runs on `device`."""
    if runs(device):
        return "conv through causal_conv1d (causal_conv1d_fn for prefill, causal_conv1d_update for decode)"
    reason = "not on CUDA" if device.type != "cuda" else probe_error(_index(device))
    return f"conv in torch ({reason})"


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def probe_error(index: int) -> str | None:
    """None when causal_conv1d imports and both kernels match torch on cuda:`index` (once per device), else why."""
    try:
        import causal_conv1d  # noqa: F401
    except Exception as exc:  # a build for another CUDA or torch raises more than ImportError
        return f"causal_conv1d does not import: {type(exc).__name__}: {exc}"
    try:
        gen = torch.Generator(device=f"cuda:{index}").manual_seed(0)
        dim, width, length = 16, 4, 5
        x, pool, weight = (
            torch.randn(*shape, generator=gen, device=f"cuda:{index}")
            for shape in ((length, dim), (3, dim, width - 1), (dim, width))
        )
        window = torch.cat([pool[2], x.t()], dim=1)
        want = F.silu(F.conv1d(window[None], weight[:, None], groups=dim)[0]).t()
        got_prefill = prefill(x, pool[2], weight)
        index_t = torch.tensor([2], device=f"cuda:{index}")
        got_update = update(x[:1].clone(), pool, weight, index_t)
        want_update = F.silu((window[:, :width] * weight).sum(-1))
        fine = (
            torch.allclose(got_prefill, want, atol=1e-4, rtol=1e-4)
            and torch.allclose(got_update[0], want_update, atol=1e-4, rtol=1e-4)
            and torch.equal(pool[2], window[:, 1:width])
        )
    except Exception as exc:  # an older release without conv_state_indices, no kernel for this GPU, ...
        return f"causal_conv1d fails on this GPU: {type(exc).__name__}: {exc}"
    return None if fine else "causal_conv1d gives other numbers than torch on this GPU"


def update(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of each of B sequences: x [B, dim]; conv_pool [slots, dim, K - 1] (x's dtype), whose windows at
    `index` [B] are read and shifted by x in place; weight [dim, K]; bias [dim] or None. Returns SiLU(conv) [B, dim]."""
    from causal_conv1d import causal_conv1d_update

    return causal_conv1d_update(
        x=x,
        conv_state=conv_pool,
        weight=weight,
        bias=bias,
        activation="silu",
        conv_state_indices=index.to(torch.int32),
    )


def prefill(
    x: torch.Tensor, before: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """One sequence's rows x [T, dim] after its window `before` [dim, K - 1] (bias [dim] or None). Returns SiLU(conv)
    [T, dim]; the caller keeps the new window (the kernel takes initial states only channel-last, hence the
    transposes)."""
    from causal_conv1d import causal_conv1d_fn

    initial = before.to(x.dtype).t().contiguous().t()[None]  # [1, dim, K - 1], channels innermost
    return causal_conv1d_fn(x=x.t()[None], weight=weight, bias=bias, initial_states=initial, activation="silu")[0].t()
