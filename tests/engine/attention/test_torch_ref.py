"""TorchRefBackend against dense causal attention computed directly from each request's full K/V."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import create_backend
from engine.attention.torch_ref import BUCKET_OVERHEAD_ROWS, TorchRefBackend, _split
from engine.errors import StartupError

HQ, HK, D = 6, 2, 8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [q_len, HQ, D] at the last q_len positions of k, v [kv_len, HK, D]; float64 math."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    allowed = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_steps(harness, steps: list[list[tuple[str, int]]], dtype=torch.float32):
    """Each step: (request, number of new tokens). Checks every step's output against dense attention."""
    gen = torch.Generator().manual_seed(0)
    backend = TorchRefBackend("cpu")
    k_cache, v_cache = harness.kv_caches[0]
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in steps:
        _, _, meta = harness.step([(rid, [0] * n) for rid, n in step])
        t = sum(n for _, n in step)
        q = torch.randn(t, HQ, D, generator=gen).to(dtype)
        k = torch.randn(t, HK, D, generator=gen).to(dtype)
        v = torch.randn(t, HK, D, generator=gen).to(dtype)
        backend.plan(meta)
        backend.write_kv(k, v, k_cache, v_cache)
        out = backend.run(q, k_cache, v_cache)
        assert out.shape == q.shape and out.dtype == dtype
        row = 0
        for rid, n in step:
            old_k, old_v = history.get(rid, (k[:0], v[:0]))
            full_k, full_v = torch.cat([old_k, k[row : row + n]]), torch.cat([old_v, v[row : row + n]])
            history[rid] = (full_k, full_v)
            ref = dense_attention(q[row : row + n], full_k, full_v)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[row : row + n].double(), ref, atol=tol, rtol=tol)
            row += n


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_prefill_then_uneven_decode(paged_harness, page_size):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=page_size, num_pages=256)
    steps = [[("a", 5), ("b", 1), ("c", 11)]] + [[("a", 1), ("b", 1), ("c", 1)]] * 5
    run_steps(harness, steps)


def test_mixed_step_chunked_prefill_and_decode(paged_harness):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4)
    steps = [
        [("a", 6), ("b", 3)],
        [("b", 1), ("a", 7), ("c", 4), ("d", 1)],  # decode rows, a chunk on cached KV, fresh prompts
        [("c", 1), ("a", 1), ("d", 5), ("b", 1)],  # a chunk after a decode row
        [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
    ]
    run_steps(harness, steps)


def test_decode_rows_of_very_different_lengths_in_buckets(paged_harness):
    # Lengths from 2 to ~600 tokens: the decode rows are split into length buckets, in a pure-decode step
    # and in a step that also holds a prefill; every row must still see exactly its own KV.
    lengths = [2, 600, 35, 410, 90, 5, 260, 599, 150, 17, 333, 64]
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4, num_pages=1024)
    names = [f"r{i}" for i in range(len(lengths))]
    prefill = [[(n, length)] for n, length in zip(names, lengths, strict=True)]
    decode = [(n, 1) for n in names]
    run_steps(harness, prefill + [decode, decode[::-1] + [("late", 9)], decode])


def test_bucket_split_cuts_where_padding_outweighs_a_bucket():
    short, long = [10] * 8, [1000] * 8
    assert _split(short + long, 0, 16, 2) == [(0, 8), (8, 16)]
    # Equal lengths never split; neither do lengths whose padding costs less than one more bucket.
    assert _split([50] * 16, 0, 16, 2) == [(0, 16)]
    near = [100] * 4 + [100 + BUCKET_OVERHEAD_ROWS // 8] * 4
    assert _split(near, 0, 8, 2) == [(0, 8)]
    assert _split([7], 0, 1, 2) == [(0, 1)]


def test_single_decode_request(paged_harness):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4)
    run_steps(harness, [[("a", 9)]] + [[("a", 1)]] * 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(paged_harness, dtype):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4, dtype=dtype)
    run_steps(harness, [[("a", 7), ("b", 2)], [("a", 1), ("b", 1)], [("b", 1), ("a", 3)]], dtype=dtype)


def test_write_kv_stores_at_slot_mapping(paged_harness):
    harness = paged_harness(num_layers=1, num_kv_heads=HK, head_dim=D, page_size=4)
    _, _, meta = harness.step([("a", [0] * 6)])
    k, v = torch.randn(6, HK, D), torch.randn(6, HK, D)
    backend = TorchRefBackend("cpu")
    backend.plan(meta)
    k_cache, v_cache = harness.kv_caches[0]
    backend.write_kv(k, v, k_cache, v_cache)
    pages = meta.kv_indices.tolist()
    for pos in range(6):
        page, off = pages[pos // 4], pos % 4
        assert torch.equal(k_cache[page, off], k[pos]) and torch.equal(v_cache[page, off], v[pos])


def test_create_backend_registry():
    assert isinstance(create_backend("torch", "cpu"), TorchRefBackend)
    with pytest.raises(StartupError, match="unknown attention backend 'nope'"):
        create_backend("nope", "cpu")
