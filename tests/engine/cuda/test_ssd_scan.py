"""The SSD as fla's simple GLA (engine/cuda/ssd_scan.py), on the CPU: its q, k, v, g and the V-first state, run
through fla-core's own torch references of the rule (token by token and chunked), give the torch SSD's outputs and
final state, from a nonzero state, with groups shared by heads and a length that is not a multiple of a chunk. fla's
Triton kernels need a GPU (tests/gpu/test_gpu_mamba2.py holds them to the torch rule); this holds the mapping. Skips
where fla does not import (it is in `make test`'s image-torch venv)."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import ssd_scan
from engine.model.layers import ssd

pytestmark = pytest.mark.skipif(
    ssd_scan.fla_import_error() is not None, reason=f"fla does not import: {ssd_scan.fla_import_error()}"
)


@pytest.mark.parametrize("length", [1, 13, 70])
def test_the_ssd_as_simple_gla_is_the_torch_rule(length):
    from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_recurrent_simple_gla

    gen = torch.Generator().manual_seed(length)
    heads, head_dim, groups, state_size = 4, 8, 2, 16
    x = torch.randn(length, heads, head_dim, generator=gen)
    dt = torch.rand(length, heads, generator=gen) + 0.1
    a = -2 * torch.rand(heads, generator=gen)
    b, c = (torch.randn(length, groups, state_size, generator=gen) for _ in range(2))
    state = torch.randn(heads, head_dim, state_size, generator=gen)
    want, want_state = ssd.chunked(x, dt, a, b, c, state, 16)
    q, k, v, g = ssd_scan.gla_inputs(x, dt, a, b, c)
    # fla's references keep the state K-first, [H, N, P]: the kernels' state_v_first=True is the slot's [H, P, N].
    initial = state.transpose(-1, -2)[None]
    recurrent = naive_recurrent_simple_gla(q[None], k[None], v[None], g[None], scale=1.0, initial_state=initial)
    chunked = naive_chunk_simple_gla(
        q[None], k[None], v[None], g[None], initial_state=initial, output_final_state=True, scale=1.0
    )
    for y, final in (recurrent, chunked):
        torch.testing.assert_close(y[0], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[0].transpose(-1, -2), want_state, atol=1e-4, rtol=1e-4)
