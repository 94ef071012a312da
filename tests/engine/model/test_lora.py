"""LoRA adapters: logits equal transformers on the merged weights, a mixed batch equals each request alone, the
prefix cache never shares KV across adapters, and adapters the engine cannot apply exactly are refused."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import AutoConfig

from engine.attention.torch_ref import TorchRefBackend
from engine.config import EngineConfig, LoraConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequest, UnsupportedModel
from engine.model.adapters import projection_shapes
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import greedy, random_prompts, run
from tests.lora_adapters import ALL_TARGETS, merge_into, peft_key, write_adapter

ATOL = 2e-4
# Three adapters unlike each other: all projections; attention only with rsLoRA; the MLP on one layer only.
ADAPTERS = {
    "all": dict(targets=ALL_TARGETS, rank=4, alpha=8.0, seed=1),
    "attn-rs": dict(targets=["q_proj", "k_proj", "v_proj", "o_proj"], rank=8, alpha=4.0, seed=2, use_rslora=True),
    "mlp-l1": dict(targets=["gate_proj", "up_proj", "down_proj"], rank=2, alpha=2.0, seed=3, layers=[1]),
}


def scale_of(spec: dict) -> float:
    return spec["alpha"] / (math.sqrt(spec["rank"]) if spec.get("use_rslora") else spec["rank"])


def write_adapters(model_path, folder, std: float = 0.1) -> dict[str, dict]:
    """The ADAPTERS for the model at model_path, written under folder; name -> (path, tensors, scale)."""
    config = AutoConfig.from_pretrained(model_path)
    out = {}
    for name, spec in ADAPTERS.items():
        tensors = write_adapter(folder / name, projection_shapes(config), config.num_hidden_layers, std=std, **spec)
        out[name] = dict(path=str(folder / name), tensors=tensors, scale=scale_of(spec))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_mixed_step_matches_transformers_on_each_adapters_merged_weights(
    kind, tmp_path, tiny_checkpoint, paged_harness
):
    hf = tiny_checkpoint(kind, tmp_path / "model")
    adapters = write_adapters(tmp_path / "model", tmp_path / "adapters", std=0.3)
    lora = LoraConfig({n: a["path"] for n, a in adapters.items()}, max_loras=4, max_lora_rank=8)
    model, spec = load_model(str(tmp_path / "model"), torch.float32, torch.device("cpu"), lora=lora)
    references = {None: hf}
    for name, a in adapters.items():
        references[name] = merged = copy.deepcopy(hf)
        merge_into(merged, a["tensors"], a["scale"])
    slots = model.lora.slots
    # Rows of one adapter apart from each other (an index group) and side by side (a slice), with base rows.
    gen = torch.Generator().manual_seed(0)
    batch = [
        ("a", "all", 5),
        ("b", None, 3),
        ("c", "all", 1),
        ("d", "attn-rs", 6),
        ("e", "mlp-l1", 4),
        ("f", "mlp-l1", 2),
        ("g", None, 1),
    ]
    prompts = {rid: torch.randint(0, 128, (n,), generator=gen).tolist() for rid, _, n in batch}
    harness = paged_harness(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    input_ids, positions, meta = harness.step([(rid, prompts[rid]) for rid, _, _ in batch])
    model.lora.plan.update([(slots.get(adapter), n) for _, adapter, n in batch], torch.device("cpu"))
    backend = TorchRefBackend("cpu")
    backend.plan(meta)
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, backend))
    row = 0
    for rid, adapter, n in batch:
        with torch.no_grad():
            ref = references[adapter](torch.tensor([prompts[rid]])).logits[0].float()
        torch.testing.assert_close(logits[row : row + n], ref, atol=ATOL, rtol=1e-4, msg=f"{rid} ({adapter})")
        if adapter is not None:  # the adapter does change the output, so the check above can fail
            assert (ref - references[None](torch.tensor([prompts[rid]])).logits[0]).abs().max() > 1e-2
        row += n


@pytest.fixture(scope="module")
def adapter_paths(tiny_model_path, tmp_path_factory):
    return {n: a["path"] for n, a in write_adapters(tiny_model_path, tmp_path_factory.mktemp("adapters")).items()}


def lora_engine(path, adapter_paths, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("num_kv_pages", 256)
    kw.setdefault("dtype", "float32")  # batch-invariant on CPU: requests are compared batched and alone
    return LLMEngine(EngineConfig(model_path=str(path), lora=LoraConfig(adapter_paths), **kw))


@pytest.fixture(scope="module")
def engine(tiny_model_path, adapter_paths):
    return lora_engine(tiny_model_path, adapter_paths)


def tokens(results) -> dict[str, list[int]]:
    return {r: res.choices[0].token_ids for r, res in results.items()}


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_request_what_it_gets_alone(engine):
    names = [None, *ADAPTERS]
    prompts = random_prompts(12, 3, 40, seed=5)
    requests = {f"r{i}": (p, greedy(16, ignore_eos=True, adapter=names[i % 4])) for i, p in enumerate(prompts)}
    together = tokens(run(engine, requests))
    alone = {r: tokens(run(engine, {r: req}))[r] for r, req in requests.items()}
    assert together == alone
    # Each adapter changes what the same prompt generates, so the equality above is not vacuous.
    per_adapter = {
        tuple(tokens(run(engine, {"x": (prompts[0], greedy(16, ignore_eos=True, adapter=a))}))["x"]) for a in names
    }
    assert len(per_adapter) == 4


def test_the_prefix_cache_never_shares_kv_across_adapters(engine, tiny_model_path, adapter_paths):
    prompt = random_prompts(1, 70, 70, seed=7)[0]  # several full pages

    def once(adapter):
        result = run(engine, {"p": (prompt, greedy(8, ignore_eos=True, adapter=adapter))})["p"]
        return result.choices[0].token_ids, result.last.num_cached_tokens

    first, cached = once("all")
    assert cached == 0
    assert once("all") == (first, 64)  # the same adapter hits its own pages
    fresh = lora_engine(tiny_model_path, adapter_paths)
    for adapter in ("attn-rs", None, "mlp-l1"):
        got, cached = once(adapter)
        assert cached == 0, f"{adapter} reused another adapter's KV"
        assert got == tokens(run(fresh, {"p": (prompt, greedy(8, ignore_eos=True, adapter=adapter))}))["p"]
    assert once(None)[1] == 64


def test_an_unknown_adapter_is_refused_naming_model(engine):
    with pytest.raises(InvalidRequest, match="nope") as info:
        engine.add_request("x", [5, 6, 7], greedy(4, adapter="nope"))
    assert info.value.param == "model"
    assert not engine.has_unfinished()


def test_no_adapters_means_no_lora_modules(tiny_model_path):
    model, _ = load_model(str(tiny_model_path), torch.float32, torch.device("cpu"), lora=LoraConfig({}))
    assert model.lora is None
    assert not any("lora" in name for name, _ in model.named_modules())


def test_bfloat16_adapters_run_on_the_packed_cpu_path(tiny_model_path, adapter_paths):
    engine = lora_engine(tiny_model_path, adapter_paths, dtype="bfloat16")
    requests = {a or "base": ([5, 9, 11, 300], greedy(6, ignore_eos=True, adapter=a)) for a in (None, "all")}
    out = tokens(run(engine, requests))
    assert len(out["all"]) == 6 and out["all"] != out["base"]


# ---- adapters the engine refuses


def adapter_folder(tmp_path, tiny_model_path, **kw):
    config = AutoConfig.from_pretrained(tiny_model_path)
    kw.setdefault("targets", ["q_proj", "v_proj"])
    write_adapter(tmp_path / "bad", projection_shapes(config), config.num_hidden_layers, **kw)
    return str(tmp_path / "bad")


def refused(tiny_model_path, folder, **lora) -> str:
    with pytest.raises(UnsupportedModel) as info:
        load_model(str(tiny_model_path), torch.float32, torch.device("cpu"), lora=LoraConfig({"bad": folder}, **lora))
    assert "\n" not in info.value.message
    return info.value.message


@pytest.mark.parametrize(
    "setting, words",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "biases"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not LoRA"),
    ],
)
def test_adapter_features_the_engine_does_not_apply_are_refused(tmp_path, tiny_model_path, setting, words):
    message = refused(tiny_model_path, adapter_folder(tmp_path, tiny_model_path, **setting))
    assert words in message and message.startswith("adapter 'bad': ")


def test_embedding_targets_wrong_shapes_and_limits_are_refused(tmp_path, tiny_model_path):
    from safetensors.torch import load_file, save_file

    folder = adapter_folder(tmp_path, tiny_model_path)
    weights = load_file(f"{folder}/adapter_model.safetensors")
    save_file(
        {**weights, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 1024)},
        f"{folder}/adapter_model.safetensors",
    )
    assert "embed_tokens" in refused(tiny_model_path, folder)

    weights[peft_key(0, "q_proj", "A")] = torch.zeros(4, 65)  # trained on a model with another hidden size
    save_file(weights, f"{folder}/adapter_model.safetensors")
    assert "another base model" in refused(tiny_model_path, folder)

    weights.pop(peft_key(0, "q_proj", "A"))
    save_file(weights, f"{folder}/adapter_model.safetensors")
    assert "without lora_B" in refused(tiny_model_path, folder)

    folder = adapter_folder(tmp_path, tiny_model_path, rank=32)
    assert "MAX_LORA_RANK=16" in refused(tiny_model_path, folder)
    assert "MAX_LORAS" in refused(tiny_model_path, adapter_folder(tmp_path, tiny_model_path), max_loras=0)

    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps([1]))
    assert "JSON object" in refused(tiny_model_path, folder)


def test_an_adapter_is_named_by_a_string():
    with pytest.raises(InvalidRequest):
        SamplingParams(adapter=3)
