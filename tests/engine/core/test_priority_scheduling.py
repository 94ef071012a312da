"""SCHEDULING_POLICY=priority (engine config scheduling_policy): a high-priority request added behind 64 low ones
gets its first token before every one of them, the lowest-priority running request is the one preempted when
pages run out, aging lets a low-priority request through a stream of high ones, and fcfs (the default) keeps
arrival order whatever the priorities say."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequest
from engine.sample.params import SamplingParams

PROMPT = list(range(10, 60))  # 50 tokens: a 64-token step budget admits one new prompt per step


def engine(model_path, policy: str, **config) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_path=str(model_path), dtype="float32", scheduling_policy=policy, max_num_batched_tokens=64, **config
        )
    )


def first_tokens(eng: LLMEngine) -> list[str]:
    """Steps the engine to the end; the request ids in the order their first token came out."""
    order: list[str] = []
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id not in order and any(o.token_ids for o in out.outputs):
                order.append(out.request_id)
    return order


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_high_priority_request_behind_64_low_ones(tiny_model_path, policy):
    eng = engine(tiny_model_path, policy)
    for i in range(64):
        eng.add_request(f"low{i}", PROMPT, SamplingParams(max_tokens=2, temperature=0, priority=5))
    eng.add_request("high", PROMPT, SamplingParams(max_tokens=2, temperature=0, priority=-1))
    order = first_tokens(eng)
    assert sorted(order) == sorted([f"low{i}" for i in range(64)] + ["high"])
    if policy == "priority":
        assert order[0] == "high"
    else:
        assert order[-1] == "high" and order[:64] == [f"low{i}" for i in range(64)]


def test_the_lowest_priority_running_request_is_preempted_first(tiny_model_path):
    # 12 pages of 16 tokens: three 50-token prompts fit, and growing them to 80 tokens each does not
    eng = engine(tiny_model_path, "priority", num_kv_pages=12, enable_prefix_caching=False)
    for name, priority in (("urgent", 0), ("normal", 1), ("idle", 9)):
        eng.add_request(name, PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, priority=priority))
    preempted: list[str] = []
    while eng.has_unfinished():
        before = eng.scheduler.num_preemptions
        eng.step()
        if eng.scheduler.num_preemptions > before:
            preempted += [g.request_id for g in eng.scheduler.waiting]
    assert preempted and set(preempted) <= {"idle", "normal"} and preempted[0] == "idle"


def test_aging_lets_a_low_priority_request_through_a_stream_of_high_ones(tiny_model_path):
    eng = engine(tiny_model_path, "priority", priority_aging_steps=2, max_num_seqs=1)
    eng.add_request("low", PROMPT, SamplingParams(max_tokens=1, temperature=0, priority=3))
    done: list[str] = []
    for i in range(40):  # a new high-priority request every step, more than one seat can serve
        eng.add_request(f"high{i}", PROMPT, SamplingParams(max_tokens=1, temperature=0, priority=0))
        done += [out.request_id for out in eng.step() if out.finished]
        if "low" in done:
            break
    assert "low" in done, "the low-priority request never ran"
    assert done.index("low") <= (3 - 0) * 2 + 2  # waited at most (3 - 0) * aging steps, plus its own run


def test_an_unknown_policy_fails_the_start(tiny_model_path):
    with pytest.raises(InvalidRequest, match="scheduling policy 'lifo'"):
        engine(tiny_model_path, "lifo")
