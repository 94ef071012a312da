"""AsyncEngine on the baked SmolLM2: concurrent streams, cancellation, aborts, errors before the first yield,
and one failing request among healthy ones."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.errors import ContextTooLong, InvalidRequest
from engine.sample.params import SamplingParams
from engine.sample.sampler import Sampler


@pytest.fixture(scope="module")
def engine(baked_model_path):
    e = AsyncEngine(
        EngineConfig(
            model_path=str(baked_model_path), dtype="float32", num_kv_pages=128, max_model_len=512, max_num_seqs=16
        )
    )
    yield e
    e.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str):
    text, tokens, outputs, last = "", [], 0, None
    async for out in engine.generate(prompt, params, rid):
        outputs += 1
        last = out
        for d in out.outputs:
            text += d.text
            tokens += d.token_ids
    return text, tokens, outputs, last


def wait_idle(engine: AsyncEngine, timeout: float = 60.0) -> None:
    """Until the engine holds no request and every page is free (liveness, not a timing check)."""
    alloc = engine.engine.allocator
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished() or alloc.num_free != alloc.num_pages:
        assert time.monotonic() < deadline, "the engine did not release the request"
        time.sleep(0.01)


def prompts(engine: AsyncEngine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(t) for t in ("The sea is", "Once upon a time, a fox", "1, 2, 3,", "Paris is the capital of")]


def test_concurrent_streams_match_sequential_runs(engine):
    ps = prompts(engine)

    async def main():
        sequential = [await collect(engine, p, greedy(8), f"s{i}") for i, p in enumerate(ps)]
        concurrent = await asyncio.gather(*(collect(engine, p, greedy(8), f"c{i}") for i, p in enumerate(ps)))
        return sequential, concurrent

    sequential, concurrent = asyncio.run(main())
    for (s_text, s_tokens, _, _), (c_text, c_tokens, outputs, last) in zip(sequential, concurrent, strict=True):
        assert (c_text, c_tokens) == (s_text, s_tokens) and len(c_tokens) == 8
        assert outputs == 8 and last.finished and last.outputs[0].finish_reason == "length"
        assert last.num_generated_tokens == 8
    wait_idle(engine)


def test_closing_or_cancelling_the_stream_frees_pages(engine):
    prompt = prompts(engine)[1]

    async def close_early():
        stream = engine.generate(prompt, greedy(400), "close")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()

    async def cancel_task():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompt, greedy(400), "cancel"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(close_early())
    wait_idle(engine)
    asyncio.run(cancel_task())
    wait_idle(engine)


def test_abort_ends_the_stream_with_abort(engine):
    async def main():
        outs = []
        async for out in engine.generate(prompts(engine)[0], greedy(400), "ab"):
            outs.append(out)
            if len(outs) == 1:
                engine.abort("ab")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and len(outs) < 400
    wait_idle(engine)


def test_errors_come_before_the_first_output(engine):
    async def main():
        with pytest.raises(ContextTooLong):
            await engine.generate(list(range(10, 600)), greedy(4), "long").__anext__()
        with pytest.raises(ContextTooLong):
            await engine.generate([10, 11], greedy(511), "long2").__anext__()
        with pytest.raises(InvalidRequest):
            await engine.generate([10, 11], greedy(4, logit_bias={10**6: 1.0}), "bias").__anext__()

    asyncio.run(main())
    assert not engine.engine.has_unfinished()


def test_a_failing_request_fails_only_its_stream(engine, monkeypatch):
    """Fault injection: the sampler raises for one request; its stream raises, the others finish."""
    ps = prompts(engine)
    real = Sampler.__call__

    def flaky(self, logits, rows):
        if any(r.params.max_tokens == 7 for r in rows):
            raise ValueError("injected")
        return real(self, logits, rows)

    async def main():
        expected = [await collect(engine, p, greedy(6), f"e{i}") for i, p in enumerate(ps[:3])]
        monkeypatch.setattr(Sampler, "__call__", flaky)
        results = await asyncio.gather(
            *(collect(engine, p, greedy(6), f"g{i}") for i, p in enumerate(ps[:3])),
            collect(engine, ps[3], greedy(7), "bad"),
            return_exceptions=True,
        )
        after = await collect(engine, ps[3], greedy(6), "after")
        return expected, results, after

    expected, results, after = asyncio.run(main())
    assert isinstance(results[3], ValueError) and str(results[3]) == "injected"
    assert [r[1] for r in results[:3]] == [e[1] for e in expected]
    assert len(after[1]) == 6  # the loop goes on serving
    wait_idle(engine)


def test_a_start_up_error_on_the_loop_thread_reaches_the_caller(engine, tmp_path):
    # The engine is built on the thread that runs its steps (one OpenMP team for torch's CPU kernels; two
    # teams on a 2-core machine cost a third of the decode speed), so its start-up errors cross threads.
    import threading

    from engine.errors import UnsupportedModel

    assert engine._thread.name == "engine-loop" and engine._thread.is_alive()
    before = threading.active_count()
    with pytest.raises(UnsupportedModel, match="no model at"):
        AsyncEngine(EngineConfig(model_path=str(tmp_path / "missing")))
    deadline = time.monotonic() + 600  # a guard against a hang, not a guess at the machine's speed
    while threading.active_count() > before:  # the failed engine's thread ends
        assert time.monotonic() < deadline
        time.sleep(0.01)
