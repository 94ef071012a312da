"""engine.cuda.kernels on CUDA: FlashInfer's fused kernels against the module's own torch fallbacks.

The RoPE module takes minutes to JIT-compile: its tests are marked slow (pytest -m slow);
bench/gpu/check.sh compiles that module in the background and runs them last.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cuda import kernels

DT = torch.bfloat16
ROOT = Path(__file__).resolve().parents[2]


def fallback(fn, *args):
    """Runs a kernels function with FlashInfer hidden, i.e. its torch code, on the same CUDA tensors."""
    saved = kernels.flashinfer_available
    kernels.flashinfer_available = lambda: False
    try:
        return fn(*args)
    finally:
        kernels.flashinfer_available = saved


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(7, 896), (5, 14, 64)])
def test_rmsnorm(shape):
    x = torch.randn(*shape, dtype=DT, device="cuda")
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(DT)
    close(kernels.rmsnorm(x, w, 1e-6), fallback(kernels.rmsnorm, x, w, 1e-6))


def test_rmsnorm_on_strided_head_view():
    # Qwen3's q_norm runs on a [tokens, heads, head_dim] view into the fused qkv rows
    qkv = torch.randn(6, (8 + 2 * 2) * 64, dtype=DT, device="cuda")
    q = qkv[:, : 8 * 64].view(6, 8, 64)
    w = torch.ones(64, dtype=DT, device="cuda")
    close(kernels.rmsnorm(q, w, 1e-6), fallback(kernels.rmsnorm, q.contiguous(), w, 1e-6))


def test_fused_add_rmsnorm_updates_both_in_place():
    x = torch.randn(9, 1024, dtype=DT, device="cuda")
    r = torch.randn(9, 1024, dtype=DT, device="cuda")
    w = (1 + 0.1 * torch.randn(1024, device="cuda")).to(DT)
    x1, r1 = x.clone(), r.clone()
    out, res = kernels.fused_add_rmsnorm(x1, r1, w, 1e-5)
    assert out.data_ptr() == x1.data_ptr() and res.data_ptr() == r1.data_ptr()
    x2, r2 = fallback(kernels.fused_add_rmsnorm, x.clone(), r.clone(), w, 1e-5)
    close(r1, r2)
    close(x1, x2)


@pytest.mark.slow
@pytest.mark.parametrize("rotary_dim", [128, 64])  # 64: GLM-4.5's partial rotary, the table's width says so
def test_rope_on_qkv_views_matches_fallback(rotary_dim):
    hq, hk, d = 8, 2, 128
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = kernels.cos_sin_cache(freqs.cos(), freqs.sin()).cuda()
    positions = torch.tensor([0, 1, 2, 700, 4095, 33], device="cuda")
    qkv = torch.randn(6, (hq + 2 * hk) * d, dtype=DT, device="cuda")
    got, want = qkv.clone(), qkv.clone()
    for t in (got, want):
        qk = t[:, : (hq + hk) * d].view(6, hq + hk, d)
        fn = kernels.apply_rope_with_cos_sin_cache_inplace
        args = (positions, qk[:, :hq], qk[:, hq:], d, cache)
        fn(*args) if t is got else fallback(fn, *args)
    close(got, want, tol=3e-2)
    assert torch.equal(got[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :]), "rope touched v"


def test_silu_and_mul():
    x = torch.randn(5, 2 * 4864, dtype=DT, device="cuda")
    close(kernels.silu_and_mul(x), fallback(kernels.silu_and_mul, x))


def test_silu_and_mul_on_rows_with_a_stride():
    # Every other row of a buffer: unit last stride, but the kernel would read rows at i * 2n.
    x = torch.randn(12, 2 * 1024, dtype=DT, device="cuda")[::2]
    close(kernels.silu_and_mul(x), fallback(kernels.silu_and_mul, x.contiguous()))


@pytest.mark.slow
def test_warmup_builds_every_kernel():
    """Warm-up makes FlashInfer build (or find in its JIT cache) and load every module the fused kernels call, so the
    first request compiles nothing: the three modules precompile() bakes (KERNEL_MODULES), each loaded once and
    compiled. Run in a fresh process (tests/gpu/warmup_probe.py), where nothing had loaded them before."""
    probe = subprocess.run(
        [sys.executable, "-m", "tests.gpu.warmup_probe", "cuda"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    found = json.loads(probe.stdout.splitlines()[-1])
    assert found["loaded_before"] == {"norm": 0, "silu_and_mul": 0, "rope": 0}
    assert found["loaded_after"] == {"norm": 1, "silu_and_mul": 1, "rope": 1}, found["loaded_after"]
    assert {name for name, compiled in found["built"].items() if compiled} >= {"norm", "silu_and_mul", "rope"}, found
