"""Running LLMEngine in tests: a tiny engine from a path, stepping requests to the end while checking the KV pool
after every step (run), and the requests the tests send (greedy, random_prompts)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.sample.params import SamplingParams

TINY_VOCAB = 1024  # the tiny engine model's vocabulary: SmolLM2's first 1024 ids


def make_engine(path, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("num_kv_pages", 256)
    # float32 unless a test says otherwise: tests compare runs batched differently, and only float32 is
    # batch-invariant on CPU (auto picks bfloat16 on CPUs with bfloat16 instructions).
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model_path=str(path), **kw))


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Result:
    choices: dict[int, Choice] = field(default_factory=dict)
    first: object = None
    last: object = None
    outputs: int = 0


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], join_at: dict[str, int] | None = None
) -> dict[str, Result]:
    """Steps the engine to the end; request r joins at step join_at[r] (default 0). Checks the pool every step."""
    join_at = join_at or {}
    results = {r: Result() for r in requests}
    pool, ptr, shape = engine.pool, engine.pool.data.data_ptr(), tuple(engine.pool.data.shape)
    step = 0
    pending = dict(requests)
    while pending or engine.has_unfinished():
        for r in [r for r in pending if join_at.get(r, 0) <= step]:
            engine.add_request(r, *pending.pop(r))
        for out in engine.step():
            res = results[out.request_id]
            res.first = res.first or out
            res.last, res.outputs = out, res.outputs + 1
            for d in out.outputs:
                c = res.choices.setdefault(d.index, Choice())
                c.text += d.text
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs or []
                if d.finish_reason:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        assert not engine.pop_failures()
        assert pool.data.data_ptr() == ptr and tuple(pool.data.shape) == shape, "the KV pool was reallocated"
        engine.allocator.check()  # free + used == total, reference counts consistent
        step += 1
        assert step < 2000
    assert engine.allocator.num_free == engine.allocator.num_pages, "pages leaked"
    if engine.kv.state is not None:
        engine.kv.state.check([])  # a hybrid model's state slots: each free or a prefix snapshot
    return results


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
