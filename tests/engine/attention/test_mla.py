"""Multi-head latent attention over latent pages (engine/attention/mla.py) with the absorbed weights equals the plain
form (per head K = [c W_UK_h^T, k_pe], V = c W_UV_h^T, causal): prefills, a chunk after cached tokens, decode
buckets of unequal lengths, over shuffled pages; run_mla's plain prefill form equals it too. An MLA group of a latent
FlashInfer does not serve runs on the torch reference, and start-up refuses FlashInfer by name for it, and FP8 pages for
any MLA group, in one line."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from engine.attention import create_group_backends, group_backends, refuse_fp8_latent_pages
from engine.attention.kv_quant import FP8
from engine.attention.mla import TorchMLABackend
from engine.errors import StartupError
from engine.model.kv_spec import LatentKV, latent_group
from tests.paging import PageTable

H, NOPE, ROPE, RANK, V = 4, 16, 8, 32, 12
SCALE = (NOPE + ROPE) ** -0.5


class Latents:
    """Each request's per-token latent c [n, RANK] and rotary key k_pe [n, ROPE], and the head weights."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.w_uk = torch.randn(H, NOPE, RANK, generator=self.gen) * 0.3
        self.w_uv = torch.randn(H, V, RANK, generator=self.gen) * 0.3
        self.c: dict[str, torch.Tensor] = {}
        self.pe: dict[str, torch.Tensor] = {}

    def new(self, rid: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """n new tokens of `rid`: their c, k_pe, q_nope [n, H, NOPE] and q_pe [n, H, ROPE]."""
        c, pe = torch.randn(n, RANK, generator=self.gen), torch.randn(n, ROPE, generator=self.gen)
        self.c[rid] = torch.cat((self.c.get(rid, c[:0]), c))
        self.pe[rid] = torch.cat((self.pe.get(rid, pe[:0]), pe))
        return c, pe, torch.randn(n, H, NOPE, generator=self.gen), torch.randn(n, H, ROPE, generator=self.gen)

    def plain(self, rid: str, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """The plain form for the last q_len tokens of rid: every head's K and V expanded from the latents."""
        c, pe = self.c[rid], self.pe[rid]
        k = torch.cat((torch.einsum("lr,hnr->hln", c, self.w_uk), pe.expand(H, -1, -1)), dim=-1)
        v = torch.einsum("lr,hvr->hlv", c, self.w_uv)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, T, NOPE + ROPE]
        t, length = q.shape[1], k.shape[1]
        mask = torch.ones(t, length, dtype=torch.bool).tril(length - t)
        scores = (q @ k.transpose(1, 2) * SCALE).masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(0, 1)  # [T, H, V]


def absorbed_step(backend, table, pools, lat: Latents, batch: list[tuple[str, int]]):
    """One step of `batch` through the backend; returns (its per-head values, the plain form's), rows in order."""
    _, meta = table.step(batch)
    backend.plan(meta)
    news = [lat.new(rid, n) for rid, n in batch]
    c, pe = torch.cat([x[0] for x in news]), torch.cat([x[1] for x in news])
    q_nope, q_pe = torch.cat([x[2] for x in news]), torch.cat([x[3] for x in news])
    q_latent = torch.einsum("thn,hnr->thr", q_nope, lat.w_uk)
    ckv, kpe = pools
    backend.write_kv(c, pe, ckv, kpe)
    out = backend.run(torch.cat((q_latent, q_pe), dim=-1), ckv, kpe)
    assert out.shape == (c.shape[0], H, RANK)
    values = torch.einsum("thr,hvr->thv", out, lat.w_uv)
    plain = [lat.plain(rid, qn, qp) for (rid, _), (_, _, qn, qp) in zip(batch, news, strict=True)]
    return values, torch.cat(plain)


def test_absorbed_latent_attention_equals_the_plain_form_over_paged_latents() -> None:
    free = list(range(64))
    random.Random(1).shuffle(free)
    table = PageTable(4, free)
    rows = torch.full((64, 4, RANK + ROPE), float("nan"))
    pools = (rows[..., :RANK], rows[..., RANK:])
    backend = TorchMLABackend("cpu", scale=SCALE)
    lat = Latents()
    steps = [
        [("a", 9), ("b", 1), ("c", 17)],  # prefills of several lengths (one of a single token)
        [("a", 1), ("b", 1), ("c", 1)],  # decode, unequal lengths
        [("a", 5), ("b", 1)],  # a chunk after cached tokens beside a decode
        [("b", 1), ("c", 1), ("a", 1)] + [(f"d{i}", 1) for i in range(6)],  # decode buckets
    ]
    for batch in steps:
        values, plain = absorbed_step(backend, table, pools, lat, batch)
        torch.testing.assert_close(values, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("plain", [True, False, None])
def test_run_mla_takes_prefill_chunks_by_either_form_and_both_equal_the_plain_reference(plain) -> None:
    """run_mla: decode rows absorbed, prefill chunks plain (True), absorbed (False) or by cost (None: the 30-row
    prefill plain, the 5-row chunk absorbed); every head's value equals the plain form's."""
    from engine.attention.mla import plain_prefill

    assert plain_prefill(30, RANK, NOPE, V, None) and not plain_prefill(5, RANK, NOPE, V, None)
    free = list(range(64))
    random.Random(2).shuffle(free)
    table = PageTable(4, free)
    rows = torch.full((64, 4, RANK + ROPE), float("nan"))
    ckv, kpe = rows[..., :RANK], rows[..., RANK:]
    backend = TorchMLABackend("cpu", scale=SCALE, plain_prefill=plain)
    lat = Latents(seed=3)
    for batch in ([("a", 30), ("b", 1), ("c", 6)], [("a", 1), ("c", 5), ("b", 1)], [("a", 1), ("b", 1)]):
        _, meta = table.step(batch)
        backend.plan(meta)
        news = [lat.new(rid, n) for rid, n in batch]
        backend.write_kv(torch.cat([x[0] for x in news]), torch.cat([x[1] for x in news]), ckv, kpe)
        q_nope, q_pe = torch.cat([x[2] for x in news]), torch.cat([x[3] for x in news])
        values = backend.run_mla(q_nope, q_pe, ckv, kpe, lat.w_uk, lat.w_uv)
        plain_values = torch.cat([lat.plain(rid, qn, qp) for (rid, _), (_, _, qn, qp) in zip(batch, news, strict=True)])
        torch.testing.assert_close(values, plain_values, atol=1e-4, rtol=1e-4)


def test_an_mla_group_flashinfer_does_not_serve_runs_on_the_torch_reference_and_flashinfer_by_name_refuses_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    group = latent_group(3, LatentKV(RANK, ROPE), scale=SCALE)
    (choice,) = group_backends("flashinfer", [group.head_dim], latent=[(RANK, ROPE)])
    assert choice[0] == "torch" and "MLA" in choice[1]
    with pytest.raises(StartupError, match="KV layer group 0: FlashInfer 0.5.3's multi-head latent attention") as err:
        group_backends("flashinfer", [group.head_dim], requested="flashinfer", latent=[(RANK, ROPE)])
    assert err.value.param == "attention_backend"
    spec = SimpleNamespace(num_q_heads=H)
    with caplog.at_level(logging.INFO, logger="engine.attention"):
        (backend,) = create_group_backends(
            "torch", [group], "cpu", spec=spec, dtype=torch.float32, kv_dtype=torch.float32
        )
    assert isinstance(backend, TorchMLABackend) and backend.scale == SCALE
    assert "multi-head latent attention) runs on the torch attention backend" in caplog.text
    (fp8,) = create_group_backends("torch", [group], "cpu", spec=spec, dtype=torch.bfloat16, kv_dtype=FP8)
    assert isinstance(fp8, TorchMLABackend)  # the torch reference runs MLA over FP8 pages
    with pytest.raises(
        StartupError, match="fp8 with multi-head latent attention .* torch attention backend only"
    ) as err:
        refuse_fp8_latent_pages([group], ["flashinfer"], FP8)
    assert err.value.param == "kv_cache_dtype"
    refuse_fp8_latent_pages([group], ["flashinfer"], torch.bfloat16)
