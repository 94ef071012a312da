"""Tensor parallelism's start-up refusals (one line naming the number) and its failures: a killed rank ends the
engine with a clear error at once, a hung one within the collective timeout, and no rank is ever left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.distributed.ranks import resolve_size
from engine.errors import RankFailed, StartupError
from engine.model.sharding import check_shardable
from tests.engine.core.distributed.tp_models import child_pids
from tests.engine.core.engine_run import greedy, make_engine

SHAPE = dict(num_q_heads=4, num_kv_heads=2, vocab_size=1024, intermediate_size=128)


@pytest.fixture(autouse=True)
def no_rank_left_behind():
    before = child_pids()
    yield
    assert child_pids() <= before, "a rank outlived its test"


@pytest.mark.parametrize(
    ("size", "shape", "named"),
    [
        (3, {}, "does not divide the model's 4 attention heads"),
        (2, {"vocab_size": 1023}, "does not divide the model's 1023 vocabulary entries"),
        (4, {"intermediate_size": 130}, "does not divide the model's 130 intermediate size"),
        (2, {"num_q_heads": 6, "num_kv_heads": 3}, "neither divides nor is a multiple of the model's 3 KV heads"),
        (
            2,
            {"routing": SimpleNamespace(intermediate_size=33, shared_expert_size=0)},
            "does not divide the model's 33 expert intermediate size",
        ),
        (
            4,
            {"deltanet": SimpleNamespace(num_k_heads=4, num_v_heads=6)},
            "does not divide the model's 6 linear-attention value heads",
        ),
        (
            2,
            {"layer_shapes": [(2, 16), (3, 32)]},
            "neither divides nor is a multiple of the model's 3 KV heads",
        ),  # Gemma 4
        (2, {"ple_dim": 8, "ple_vocab": 1023}, "does not divide the model's 1023 per-layer input vocabulary entries"),
    ],
)
def test_a_size_that_does_not_divide_is_refused_naming_the_number(size, shape, named):
    with pytest.raises(StartupError, match=f"tensor_parallel_size={size} {named}"):
        check_shardable("LlamaForCausalLM", SimpleNamespace(**{**SHAPE, **shape}), size)


def test_a_family_not_sharded_yet_is_refused_in_one_line():
    with pytest.raises(StartupError, match="LlamaForSequenceClassification does not run tensor-parallel yet") as info:
        check_shardable("LlamaForSequenceClassification", SimpleNamespace(**SHAPE), 2)
    assert "\n" not in info.value.message


def test_sizes_auto_and_more_ranks_than_devices():
    assert resolve_size("auto", torch.device("cpu")) == 1
    assert resolve_size(2, torch.device("cpu")) == 2
    with pytest.raises(StartupError, match="tensor_parallel_size=0 must be at least 1"):
        resolve_size(0, torch.device("cpu"))
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(StartupError, match=f"tensor_parallel_size={too_many} is more ranks than the"):
        resolve_size(too_many, torch.device("cuda"))


def test_the_engine_refuses_before_starting_any_rank(tiny_model_path):
    """A size the tiny model's 4 heads cannot take, and int4 at TP=2: refused with no process started."""
    with pytest.raises(StartupError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        make_engine(tiny_model_path, tensor_parallel_size=3)
    with pytest.raises(StartupError, match="QUANTIZATION does not run tensor-parallel yet"):
        make_engine(tiny_model_path, tensor_parallel_size=2, quantization="int4")


def _generate(engine: AsyncEngine, rid: str) -> list[int]:
    async def go() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate([5, 6, 7, 8], greedy(4), rid):
            tokens += out.outputs[0].token_ids
        return tokens

    return asyncio.run(go())


def test_a_killed_rank_ends_the_engine_with_a_clear_error(tiny_model_path):
    fatal: list[RankFailed] = []
    told = threading.Event()
    engine = AsyncEngine(
        EngineConfig(model_path=str(tiny_model_path), dtype="float32", num_kv_pages=64, tensor_parallel_size=2),
        on_fatal=lambda exc: (fatal.append(exc), told.set()),
    )
    try:
        assert len(_generate(engine, "before")) == 4
        rank = engine.engine.ranks.processes[0]
        os.kill(rank.pid, signal.SIGKILL)
        assert told.wait(timeout=60), "the engine did not notice its rank died"
        assert f"tensor-parallel rank 1 (pid {rank.pid}) exited with code -9" in fatal[0].message
        with pytest.raises(RankFailed, match="rank 1"):
            _generate(engine, "after")
    finally:
        engine.shutdown()


def test_a_hung_rank_fails_the_step_within_the_timeout(tiny_model_path):
    engine = make_engine(tiny_model_path, tensor_parallel_size=2, tensor_parallel_timeout_s=3.0)
    rank = engine.ranks.processes[0]
    try:
        os.kill(rank.pid, signal.SIGSTOP)
        engine.add_request("hung", [5, 6, 7], greedy(4))
        with pytest.raises(RankFailed, match="tensor-parallel step failed"):
            while engine.has_unfinished():
                engine.step()
        assert not rank.is_alive()  # stopped ranks are killed, not left behind
    finally:
        engine.close()
