"""LoRA adapters loaded and unloaded while the engine serves: a loaded adapter answers as the same adapter loaded at
start does, an unloaded one finishes its running requests and takes no new ones, its slot is reused only after
them, a name loaded again never meets the KV pages of its earlier weights, and bad adapters are refused in one line."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoConfig

from engine.config import EngineConfig, LoraConfig
from engine.core.async_engine import AsyncEngine
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequest, UnsupportedModel
from engine.model.adapters import projection_shapes
from tests.engine.core.engine_run import greedy, random_prompts, run
from tests.lora_adapters import ALL_TARGETS, write_adapter


def runtime_engine(path, adapters=None, **lora) -> LLMEngine:
    lora = LoraConfig(adapters or {}, **{"max_loras": 2, "max_lora_rank": 8, "runtime": True, **lora})
    return LLMEngine(EngineConfig(model_path=str(path), lora=lora, max_num_seqs=16, num_kv_pages=256, dtype="float32"))


@pytest.fixture(scope="module")
def folders(tiny_model_path, tmp_path_factory):
    """Two adapters unlike each other, and one above MAX_LORA_RANK=8."""
    root = tmp_path_factory.mktemp("runtime-adapters")
    config = AutoConfig.from_pretrained(tiny_model_path)
    shapes, layers = projection_shapes(config), config.num_hidden_layers
    write_adapter(root / "a", shapes, layers, targets=ALL_TARGETS, rank=4, std=0.3, seed=1)
    write_adapter(root / "b", shapes, layers, targets=["q_proj", "v_proj", "down_proj"], rank=8, std=0.3, seed=2)
    write_adapter(root / "wide", shapes, layers, targets=["q_proj"], rank=16, seed=3)
    return {name: str(root / name) for name in ("a", "b", "wide")}


def answer(engine: LLMEngine, prompt: list[int], adapter: str | None, n: int = 12) -> list[int]:
    result = run(engine, {"r": (prompt, greedy(n, ignore_eos=True, adapter=adapter))})["r"]
    return result.choices[0].token_ids


def load(engine: LLMEngine, name: str, folder: str) -> None:
    engine.install_adapter(name, engine.lora.read(name, folder))


def test_an_adapter_loaded_while_serving_answers_as_the_same_adapter_loaded_at_start(tiny_model_path, folders):
    prompt = random_prompts(1, 20, 20, seed=3)[0]
    at_start = runtime_engine(tiny_model_path, {"a": folders["a"]})
    later = runtime_engine(tiny_model_path)
    base = answer(later, prompt, None)
    assert later.adapters == {}
    load(later, "a", folders["a"])
    assert answer(later, prompt, "a") == answer(at_start, prompt, "a") != base
    assert answer(later, prompt, None) == base  # the base rows are untouched by the new slot


def test_an_unloaded_adapter_finishes_what_runs_and_its_slot_waits_for_it(tiny_model_path, folders):
    engine = runtime_engine(tiny_model_path, max_loras=1)
    prompt = random_prompts(1, 16, 16, seed=4)[0]
    load(engine, "a", folders["a"])
    alone = answer(engine, prompt, "a", n=10)
    engine.add_request("running", prompt, greedy(10, ignore_eos=True, adapter="a"))
    tokens = [t for out in engine.step() for t in out.outputs[0].token_ids]
    engine.remove_adapter("a")
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'a'"):
        engine.add_request("late", prompt, greedy(4, adapter="a"))
    with pytest.raises(UnsupportedModel, match="all 1 LoRA slots are taken"):
        load(engine, "b", folders["b"])  # the only slot is still read by "running"
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.outputs[0].token_ids]
    assert tokens == alone  # it kept its adapter to the end
    load(engine, "b", folders["b"])  # free now
    assert answer(engine, prompt, "b", n=10) != alone


def test_a_name_loaded_again_with_other_weights_never_reuses_its_earlier_pages(tiny_model_path, folders):
    engine = runtime_engine(tiny_model_path)
    prompt = random_prompts(1, 70, 70, seed=7)[0]  # several full pages
    load(engine, "x", folders["a"])
    first = run(engine, {"r": (prompt, greedy(8, ignore_eos=True, adapter="x"))})["r"]
    again = run(engine, {"r": (prompt, greedy(8, ignore_eos=True, adapter="x"))})["r"]
    assert again.last.num_cached_tokens == 64  # the same load hits its own pages
    engine.remove_adapter("x")
    load(engine, "x", folders["b"])
    reloaded = run(engine, {"r": (prompt, greedy(8, ignore_eos=True, adapter="x"))})["r"]
    assert reloaded.last.num_cached_tokens == 0
    cold = runtime_engine(tiny_model_path, {"x": folders["b"]})
    assert reloaded.choices[0].token_ids == answer(cold, prompt, "x", n=8) != first.choices[0].token_ids


def test_bad_adapters_and_names_are_refused_in_one_line(tiny_model_path, folders, tmp_path):
    engine = runtime_engine(tiny_model_path)
    with pytest.raises(UnsupportedModel, match="rank 16, above MAX_LORA_RANK=8"):
        engine.lora.read("wide", folders["wide"])
    with pytest.raises(UnsupportedModel, match="is not a PEFT adapter"):
        engine.lora.read("none", str(tmp_path))
    other = AutoConfig.from_pretrained(tiny_model_path)
    shapes = {k: (o * 2, i) for k, (o, i) in projection_shapes(other).items()}
    write_adapter(tmp_path / "other", shapes, other.num_hidden_layers, targets=["q_proj"], rank=4)
    with pytest.raises(UnsupportedModel, match="another base model") as info:
        engine.lora.read("other", str(tmp_path / "other"))
    assert "\n" not in info.value.message
    load(engine, "a", folders["a"])
    with pytest.raises(InvalidRequest, match="has already been loaded"):
        load(engine, "a", folders["b"])
    with pytest.raises(InvalidRequest, match="cannot be found"):
        engine.remove_adapter("nope")
    assert list(engine.adapters) == ["a"]


def test_the_async_engine_loads_between_steps_while_a_stream_runs(tiny_model_path, folders):
    engine = AsyncEngine(
        EngineConfig(
            model_path=str(tiny_model_path),
            dtype="float32",
            num_kv_pages=256,
            lora=LoraConfig({}, max_loras=2, max_lora_rank=8, runtime=True),
        )
    )
    prompt = random_prompts(1, 12, 12, seed=9)[0]

    async def scenario() -> tuple[list[int], list[int]]:
        streamed, loaded = [], []
        stream = engine.generate(prompt, greedy(40, ignore_eos=True), "base")
        async for out in stream:
            streamed += out.outputs[0].token_ids
            if len(streamed) == 2:
                await engine.load_adapter("a", folders["a"])  # while "base" is still decoding
                async for other in engine.generate(prompt, greedy(6, ignore_eos=True, adapter="a"), "a"):
                    loaded += other.outputs[0].token_ids
        return streamed, loaded

    try:
        streamed, loaded = asyncio.run(scenario())
        assert engine.adapters == ["a"] and len(streamed) == 40 and len(loaded) == 6
        with pytest.raises(UnsupportedModel, match="rank 16"):
            asyncio.run(engine.load_adapter("wide", folders["wide"]))
        asyncio.run(engine.unload_adapter("a"))
        assert engine.adapters == []
    finally:
        engine.shutdown()
