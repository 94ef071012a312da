"""FlashInfer's multi-head latent attention (engine/attention/flashinfer_mla.py) against the torch reference
(engine/attention/mla.py) on the same latent pages, on the GPU: DeepSeek's latent (512 + 64) with 16 heads in
bfloat16, prefills of several lengths, a chunk after cached tokens, a prefix-cache hit, decode batches of unequal
lengths, run_mla() (W_UK absorbed before the kernel, W_UV after) and run() on absorbed queries; the head counts of one
tensor-parallel rank; a long prefill against the reference's plain form; and the engine's choice of it for such a
group on CUDA, warm-up included."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from engine.attention.mla import TorchMLABackend, absorb
from tests.paging import PageTable

H, NOPE, ROPE, RANK, V = 16, 128, 64, 512, 128  # DeepSeek-V2-Lite's widths and head count
SCALE = (NOPE + ROPE) ** -0.5
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def run_steps(
    steps,
    *,
    page_size: int,
    dtype=torch.bfloat16,
    shares=(),
    plain_prefill: bool | None = None,
    num_heads: int = H,
) -> None:
    """Each step: (request, new tokens). Both backends write their own pages and attend; every head's values (and the
    output latents of run()) and the pages must agree. shares: (before step index, src, dst, pages) prefix hits."""
    from engine.attention.flashinfer_mla import FlashInferMLABackend

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * std).to(dtype)

    free = list(range(1, 256))  # never page 0, shuffled
    random.Random(0).shuffle(free)
    table = PageTable(page_size, free)
    rows = {name: torch.full((256, page_size, RANK + ROPE), 7.0, dtype=dtype, device="cuda") for name in ("ref", "fi")}
    fi = FlashInferMLABackend(
        device="cuda", num_heads=num_heads, kv_lora_rank=RANK, rope_dim=ROPE, dtype=dtype, scale=SCALE
    )
    ref = TorchMLABackend("cuda", scale=SCALE, plain_prefill=plain_prefill)
    w_uk, w_uv = randn(num_heads, NOPE, RANK, std=RANK**-0.5), randn(num_heads, V, RANK, std=RANK**-0.5)
    for index, step in enumerate(steps):
        for at, src, dst, pages in shares:
            if at == index:
                table.pages[dst] = list(table.pages[src][:pages])
                table.lengths[dst] = pages * page_size
        _, meta = table.step(step, device="cuda")
        t = sum(n for _, n in step)
        latent, k_pe = randn(t, RANK), randn(t, ROPE)
        q_nope, q_pe = randn(t, num_heads, NOPE), randn(t, num_heads, ROPE)
        q = torch.cat((absorb(q_nope, w_uk), q_pe), dim=-1)
        values, latents = {}, {}
        for name, backend in (("ref", ref), ("fi", fi)):
            backend.plan(meta)
            ckv, kpe = rows[name][..., :RANK], rows[name][..., RANK:]
            backend.write_kv(latent, k_pe, ckv, kpe)
            values[name] = backend.run_mla(q_nope, q_pe, ckv, kpe, w_uk, w_uv)
            latents[name] = backend.run(q, ckv, kpe)
        assert values["fi"].shape == (t, num_heads, V) and values["fi"].dtype == dtype
        assert latents["fi"].shape == (t, num_heads, RANK)
        assert torch.isfinite(values["fi"]).all()
        tol = TOL[dtype]
        torch.testing.assert_close(values["fi"], values["ref"], atol=tol, rtol=tol)
        torch.testing.assert_close(latents["fi"], latents["ref"], atol=tol, rtol=tol)
    assert torch.equal(rows["fi"], rows["ref"]), "write_kv stored different latents"


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefills_of_several_lengths_then_decode_batches_of_unequal_lengths(page_size):
    steps = [[("a", 37), ("b", 1), ("c", 16), ("d", 100)]] + [[("a", 1), ("b", 1), ("c", 1), ("d", 1)]] * 3
    run_steps(steps, page_size=page_size)


def test_a_chunk_after_cached_tokens_beside_decode_rows_and_a_prefix_hit():
    steps = [
        [("a", 40), ("b", 17)],
        [("a", 23), ("b", 1)],  # a's second chunk after 40 cached tokens, beside b's decode row
        [("a", 1), ("b", 1), ("c", 9)],  # c starts on a's first 2 pages (a prefix-cache hit), then prefills 9
        [("c", 1), ("a", 1), ("b", 1)] + [(f"d{i}", 1 + 7 * i) for i in range(4)],
        [("c", 1), ("a", 1), ("b", 1)] + [(f"d{i}", 1) for i in range(4)],
    ]
    run_steps(steps, page_size=16, shares=[(2, "a", "c", 2)])


# One tensor-parallel rank's heads (its pages hold whole latent rows): 16 heads at TP=8 (DeepSeek-V2-Lite), 20 at TP=4
# and TP=2, 64 at TP=8, 128 at TP=2 (DeepSeek-V3).
@pytest.mark.parametrize("num_heads", [2, 5, 10, 8, 64])
def test_the_head_counts_of_a_tensor_parallel_rank(num_heads):
    steps = [[("a", 37), ("b", 1), ("c", 70)], [("a", 1), ("b", 1), ("c", 1)]]
    run_steps(steps, page_size=16, num_heads=num_heads)


def test_a_long_prefill_against_the_references_plain_form():
    run_steps([[("a", 300), ("b", 5)], [("a", 1), ("b", 1)]], page_size=16, plain_prefill=True)


@pytest.mark.slow  # float16 builds a second MLA module
def test_float16():
    run_steps([[("a", 37), ("b", 1)], [("a", 1), ("b", 1)]], page_size=16, dtype=torch.float16)


def test_the_engine_gives_deepseeks_latent_group_flashinfer_on_cuda_and_warms_it_up(caplog):
    from engine.attention import create_group_backends
    from engine.attention.flashinfer_mla import FlashInferMLABackend
    from engine.model.kv_spec import LatentKV, latent_group

    group = latent_group(2, LatentKV(RANK, ROPE), scale=SCALE)
    spec = SimpleNamespace(num_q_heads=H)
    with caplog.at_level(logging.INFO, logger="engine.attention"):
        (backend,) = create_group_backends(
            "flashinfer", [group], "cuda", spec=spec, dtype=torch.bfloat16, kv_dtype=torch.bfloat16
        )
    assert isinstance(backend, FlashInferMLABackend) and backend.scale == SCALE
    assert "runs on the flashinfer attention backend" in caplog.text
    backend.warmup(page_size=16)
    (tiny,) = create_group_backends(
        "flashinfer",
        [latent_group(2, LatentKV(32, 16), scale=SCALE)],
        "cuda",
        spec=spec,
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
    )
    assert isinstance(tiny, TorchMLABackend)
