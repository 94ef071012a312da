"""A multi-head latent attention (MLA) KV group: its pages hold per token and layer the compressed latent and the
rotary key part (DeepSeek V3: 512 + 64 = 576 values) instead of K and V of every head, as the pair (ckv, kpe) that
FlashInfer's MLA wrapper takes, and the KV sizing and the bake's --plan count those bytes."""

from __future__ import annotations

import torch

from engine.core.kv.cache import LatentPagePool, PagePool
from engine.core.kv.sizing import page_bytes, pages_for_budget, window_caps
from engine.model.kv_spec import KVGroupSpec, LatentKV, describe_groups, graphs_blocker, latent_group
from engine.model.memory_plan import GroupKV, MemoryPlan, describe

V3 = LatentKV(kv_lora_rank=512, rope_dim=64)


def test_an_mla_group_counts_the_latent_and_rope_values_per_token_and_layer() -> None:
    group = latent_group(61, V3, scale=0.1)
    assert group.values_per_token == 576  # against 2 * 128 heads * 128 = 32,768 with full K and V heads
    assert (group.num_kv_heads, group.head_dim) == (1, 576)
    for dtype in (torch.bfloat16, torch.float32):
        assert page_bytes([group], 16, dtype) == [61 * 16 * (512 + 64) * dtype.itemsize]
    full = KVGroupSpec(layers=tuple(range(61)), num_kv_heads=128, head_dim=128)
    assert page_bytes([full], 16, torch.bfloat16) == [61 * 16 * 32768 * 2]
    assert describe_groups([group]) == "mla(512+64):61x"
    assert "latent" in graphs_blocker([group])


def test_the_budget_holds_as_many_latent_pages_as_their_bytes_allow() -> None:
    group = latent_group(2, LatentKV(32, 8), scale=0.2)
    sizes = page_bytes([group], 4, torch.float32)
    assert sizes == [2 * 4 * 40 * 4]
    assert pages_for_budget(100 * sizes[0] + 7, sizes, window_caps([group], 4, 8, 16)) == 100


def test_the_latent_pool_is_the_pair_ckv_kpe_per_layer_and_copies_pages_whole() -> None:
    group = latent_group(3, LatentKV(32, 8), scale=0.2)
    pool = PagePool.for_group(group, 5, 4, torch.bfloat16, "cpu")
    assert isinstance(pool, LatentPagePool) and len(pool.kv_caches) == 3
    assert pool.nbytes == page_bytes([group], 4, torch.bfloat16)[0] * 5
    for layer, (ckv, kpe) in enumerate(pool.kv_caches):
        assert ckv.shape == (5, 4, 32) and kpe.shape == (5, 4, 8)
        # FlashInfer takes strided views; the torch backend flattens the page axes without a copy
        assert ckv.view(-1, 32).data_ptr() == ckv.data_ptr()
        ckv[1].fill_(layer + 1)
        kpe[1].fill_(-(layer + 1))
        ckv[3].zero_()
        kpe[3].zero_()
    pool.copy_pages([1], [3])
    for layer, (ckv, kpe) in enumerate(pool.kv_caches):
        assert torch.all(ckv[3] == layer + 1) and torch.all(kpe[3] == -(layer + 1))


def test_the_plan_prints_the_latent_values_per_token() -> None:
    plan = MemoryPlan(
        weight_bytes=10**9,
        groups=(GroupKV(61, 61 * 576 * 2, None, latent_width=576),),
        reserve_bytes=10**9,
        max_num_seqs=256,
    )
    lines = describe(plan, 0.9)
    assert "KV 68.6 KiB per token over 61 layers (full attention, multi-head latent: 576 values per token" in lines[1]
