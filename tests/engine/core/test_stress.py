"""Randomized stress of the engine's page ownership: tiny page pools, chunked prefill, prefix caching on and
off, n / best_of / beam search, stop strings, logprobs and random aborts, with every reference count rebuilt
from the live sequences after every step and every finished greedy or beam result compared with the same
request run alone. CI runs a few seeds; `pytest -m slow tests/engine/test_stress.py` runs 200.

Two models: a full-attention Llama (one KV group) and a Qwen2 with two KV groups (full attention, and a sliding
window of two pages whose sequences must hold at most ceil(W / page_size) + 1 real pages between steps).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.core.engine import LLMEngine
from engine.model.kv_spec import KVGroupSpec
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import TINY_VOCAB, make_engine

CI_SEEDS = range(3)
SLOW_SEEDS = range(3, 203)


def _params(rng: random.Random) -> tuple[SamplingParams, bool]:
    """Random parameters, and whether the result is deterministic (compared with the solo run)."""
    kind = rng.choice(["greedy", "greedy", "stop", "logprobs", "n", "best_of", "beam"])
    max_tokens = rng.randint(1, 14)
    if kind == "beam":
        return SamplingParams(
            use_beam_search=True,
            n=rng.randint(1, 2),
            best_of=rng.randint(2, 3),
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
        ), True
    if kind == "n":
        return SamplingParams(
            n=rng.randint(2, 3), temperature=1.0, seed=rng.randrange(100), max_tokens=max_tokens
        ), False
    if kind == "best_of":
        return SamplingParams(
            n=1, best_of=rng.randint(2, 3), temperature=1.0, seed=rng.randrange(100), max_tokens=max_tokens
        ), False
    extra = {"stop": ["e", "an"]} if kind == "stop" else {"logprobs": 2} if kind == "logprobs" else {}
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5, **extra), True


def _requests(rng: random.Random, count: int) -> dict[str, tuple[list[int], SamplingParams, bool]]:
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(4, 12))]
    out = {}
    for i in range(count):
        tail = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 16))]
        prompt = (shared + tail) if rng.random() < 0.5 else tail
        out[f"r{i}"] = (prompt, *_params(rng))
    return out


def _tokens(engine: LLMEngine, requests: dict, aborts: dict[str, int], rng: random.Random) -> dict[str, dict]:
    """Runs the requests (joining at random steps, some aborted), checking the pages after every step."""
    joins = {r: rng.randint(0, 6) for r in requests}
    pending, results, step = dict(requests), {r: {} for r in requests}, 0
    while pending or engine.has_unfinished():
        for r in [r for r in pending if joins[r] <= step]:
            prompt, params, _ = pending.pop(r)
            engine.add_request(r, prompt, params)
        for r, at in aborts.items():
            if at == step:
                engine.abort(r)
                results[r] = None
        for out in engine.step():
            if results.get(out.request_id) is not None:
                for d in out.outputs:
                    results[out.request_id].setdefault(d.index, []).extend(d.token_ids)
        failures = engine.pop_failures()
        assert not failures, failures
        _check_references(engine)
        step += 1
        assert step < 3000, "did not finish"
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    return results


def _check_references(engine: LLMEngine) -> None:
    """In every KV group, every page's reference count equals the live sequences that hold it (the allocators'
    own checks too); in a window group, a sequence holds real pages exactly from the first one its next query
    reads, NULL before, at most ceil(W / page_size) + 1 of them."""
    kv = engine.kv
    kv.check()
    seqs = [seq for group in [*engine.scheduler.running, *engine.scheduler.waiting] for seq in group.seqs]
    for g, (spec, allocator, null) in enumerate(zip(kv.specs, kv.allocators, kv.null_pages, strict=True)):
        held = Counter(page for seq in seqs if seq.kv_pages for page in seq.kv_pages[g] if page != null)
        counts = allocator.ref_counts
        assert all(counts[page] == n for page, n in held.items()), f"group {g}: a count differs from its holders"
        assert sum(1 for c in counts if c > 0) == len(held), f"group {g}: a page is counted that no sequence holds"
        if null is not None:
            _check_window(spec, null, kv.page_size, [s for s in seqs if s.kv_pages], g)


def _check_window(spec: KVGroupSpec, null: int, page_size: int, seqs: list, g: int) -> None:
    for seq in seqs:
        pages = seq.kv_pages[g]
        first = spec.first_needed_page(seq.num_computed_tokens, page_size)
        assert pages[:first] == [null] * first and null not in pages[first:], (first, pages)
        assert len(pages) - first <= spec.window_pages(page_size), "a window holds too many pages"


def _stress(path, seed: int, groups: int) -> None:
    rng = random.Random(seed)
    requests = _requests(rng, rng.randint(6, 12) if groups == 1 else rng.randint(12, 18))
    aborts = {r: rng.randint(0, 20) for r in requests if rng.random() < 0.2}
    kw = dict(
        num_kv_pages=rng.randint(24, 48),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([4, 8, 16]),
        enable_prefix_caching=rng.random() < 0.7,
    )
    if groups > 1:  # more requests at once in a tight pool: preemption comes often, with windows too
        kw.update(num_kv_pages=24 + kw["num_kv_pages"] % 4, max_num_seqs=16)
    engine = make_engine(path, page_size=4, max_model_len=48, **kw)
    assert len(engine.kv.specs) == groups
    got = _tokens(engine, requests, aborts, rng)
    solo = make_engine(path, num_kv_pages=64, max_model_len=48)
    for r, (prompt, params, deterministic) in requests.items():
        if got[r] is None or not deterministic:
            continue
        alone = _tokens(solo, {r: (prompt, params, True)}, {}, random.Random(0))[r]
        assert got[r] == alone, (seed, r, params)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_random_loads_keep_every_page_accounted_for(tiny_model_path, seed: int) -> None:
    _stress(tiny_model_path, seed, groups=1)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_random_loads_with_a_window_group(tiny_window_model_path, seed: int) -> None:
    _stress(tiny_window_model_path, seed, groups=2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_random_loads_long(tiny_model_path, seed: int) -> None:
    _stress(tiny_model_path, seed, groups=1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_random_loads_long_with_a_window_group(tiny_window_model_path, seed: int) -> None:
    _stress(tiny_window_model_path, seed, groups=2)
