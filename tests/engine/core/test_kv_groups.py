"""KV cache layer groups: reading them from a config, sizing their pools from one budget, and the manager's
window rules (sliding, prefix hits a window group can serve, sharing a prompt a window already dropped)."""

from __future__ import annotations

import pytest

from engine.core.kv.manager import KVCacheManager
from engine.core.kv.sizing import group_pages, pages_for_budget, window_caps
from engine.core.scheduling.sequence import Sequence
from engine.model.kv_spec import KVGroupSpec, kv_groups, layer_windows
from tests.engine.core.engine_run import make_engine

FULL, WIN = (
    KVGroupSpec(layers=(0,), num_kv_heads=2, head_dim=8),
    KVGroupSpec(layers=(1, 2), num_kv_heads=2, head_dim=8, window=8),
)
PS = 4


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        ({"model_type": "llama"}, [None] * 3),
        ({"model_type": "mistral", "sliding_window": 16}, [16] * 3),
        ({"model_type": "mistral", "sliding_window": None}, [None] * 3),
        ({"model_type": "qwen2", "sliding_window": 16, "max_window_layers": 1}, [None] * 3),  # off by default
        (
            {"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1},
            [None, 16, 16],
        ),
        (
            {
                "model_type": "gemma3",
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            },
            [16, None, 16],
        ),
    ],
)
def test_layer_windows_as_transformers_reads_them(config, windows):
    assert layer_windows(config, 3) == windows


def test_groups_in_order_of_first_layer():
    groups = kv_groups([16, None, 16, None], 2, 8)
    assert groups == [
        KVGroupSpec(layers=(0, 2), num_kv_heads=2, head_dim=8, window=16),
        KVGroupSpec(layers=(1, 3), num_kv_heads=2, head_dim=8, window=None),
    ]
    assert [g.label for g in groups] == ["window(16):2x", "full:2x"]
    assert kv_groups([None] * 4, 2, 8) == [KVGroupSpec(layers=(0, 1, 2, 3), num_kv_heads=2, head_dim=8, window=None)]


def test_budget_split_across_groups():
    assert pages_for_budget(10_000, [100], [None]) == 100  # one full group: budget // page bytes, as before
    caps = window_caps([FULL, WIN], PS, max_num_seqs=2, max_num_batched_tokens=8)
    assert caps == [None, 2 * (3 + 1) + 2]
    # The window group takes its cap (10 pages of 200 bytes), the full group the rest.
    assert group_pages(caps, pages_for_budget(10_000, [100, 200], caps)) == [80, 10]
    # A budget too small for the cap: both groups shrink together.
    assert group_pages(caps, pages_for_budget(1_500, [100, 200], caps)) == [5, 5]
    # Only window groups: each at its cap once the budget allows it.
    assert group_pages([10], pages_for_budget(10**6, [200], [10])) == [10]


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(seq_id=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))


def _run(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    copies: list = []
    kv.allocate(seq, n, copies)
    kv.commit(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)


def test_window_pages_slide_out_and_come_back():
    kv = KVCacheManager(specs=[FULL, WIN], num_pages=[32, 32], page_size=PS)
    null = kv.null_pages[1]
    seq = _seq(list(range(10, 31)))
    _run(kv, seq, 20)
    # The next query (position 20) sees keys 13..20: pages 0-2 are out of the window.
    assert seq.kv_pages[1][:3] == [null] * 3 and null not in seq.kv_pages[1][3:]
    assert len(seq.kv_pages[0]) == len(seq.kv_pages[1]) == 5
    assert kv.allocators[1].num_free == 32 - 2 and kv.allocators[0].num_free == 32 - 5
    kv.free(seq)
    again = _seq(list(range(10, 31)))
    kv.lookup(again)  # a hit past the window: every full page, and the window's pages of its end
    assert again.num_computed_tokens == 20 and again.kv_pages[1][:3] == [null] * 3
    kv.check()


def test_prefix_hit_shortened_to_what_the_window_group_holds():
    kv = KVCacheManager(specs=[FULL, WIN], num_pages=[16, 16], page_size=PS)
    seq = _seq(list(range(1, 22)))
    hashes = seq.hashes(5, PS)
    full = kv.allocators[0].allocate(5)
    for page, h in zip(full, hashes, strict=True):
        kv.allocators[0].register(page, h)
    win = kv.allocators[1].allocate(2)
    for page, h in zip(win, hashes[2:4], strict=True):  # the window group kept pages 2 and 3, not 4
        kv.allocators[1].register(page, h)
    kv.allocators[0].free(full)
    kv.allocators[1].free(win)
    kv.lookup(seq)
    # 5 pages would need window pages 3-4; 4 pages need 2-3, which are there.
    assert seq.num_computed_tokens == 16
    assert seq.kv_pages == [full[:4], [kv.null_pages[1]] * 2 + win]
    kv.check()


def test_a_prompt_the_lead_window_dropped_is_not_shared():
    kv = KVCacheManager(specs=[FULL, WIN], num_pages=[32, 32], page_size=PS)
    lead, other = _seq(list(range(1, 30))), _seq(list(range(1, 30)))
    _run(kv, lead, 12)
    assert kv.share_prefix(lead, other, 3)  # at the lead's own position: the window pages are all there
    assert other.num_computed_tokens == 12 and other.kv_pages == lead.kv_pages
    kv.free(other)
    _run(kv, lead, 12)  # the lead went on: pages 0-3 left its window
    assert not kv.share_prefix(lead, other, 3) and not other.kv_pages
    kv.free(lead)
    assert kv.num_free == [32, 32]


def test_full_attention_engine_keeps_its_pool_figures(tiny_model_path):
    engine = make_engine(tiny_model_path, num_kv_pages=None, max_model_len=256, max_num_seqs=4)
    info = engine.describe()
    # The CPU default as before groups: max_num_seqs sequences of max_model_len tokens, 2 layers x K,V x 16 x 2 x 16.
    assert info["kv_groups"] == "full:2x" and info["kv_pages"] == 4 * 256 // 16
    assert info["kv_bytes"] == 64 * 2 * 2 * 16 * 2 * 16 * 4 and len(engine.pools) == 1


def test_window_engine_sizes_its_window_group_by_its_cap(tiny_window_model_path):
    engine = make_engine(
        tiny_window_model_path, num_kv_pages=200, page_size=4, max_num_seqs=4, max_num_batched_tokens=16
    )
    assert engine.describe()["kv_groups"] == "full:1x,window(8):2x"
    assert engine.describe()["kv_pages_by_group"] == [200, 4 * (3 + 1) + 4]
    assert engine.pools[1].num_pages == 21  # and the NULL page
