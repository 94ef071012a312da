"""Tiny random Llama and Qwen3 models quantized into each format (quant_writers.py) load, pass the bake's check and
reproduce transformers running the weights each checkpoint stands for: logits on a batch of mixed prompts equal
to each alone, decode steps, greedy sequences."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from engine.attention.torch_ref import TorchRefBackend
from engine.config import LoraConfig
from engine.errors import UnsupportedModel
from engine.model.adapters import projection_shapes
from engine.model.layers.linear import Int4Linear
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.quant_writers import TINY, write_quantized
from tests.lora_adapters import ALL_TARGETS, merge_into, write_adapter

KINDS = ["awq", "gptq", "gptq_asym", "ct_int4", "ct_fp8", "fp8_block"]
INT4 = {"awq", "gptq", "gptq_asym", "ct_int4"}
ATOL = 2e-4  # float32: the int4 kernel's (code - 8) * s + (8 - z) * s rounds apart from (code - z) * s


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def run_step(model, harness, batch) -> torch.Tensor:
    input_ids, positions, meta = harness.step(batch)
    backend = TorchRefBackend("cpu")
    backend.plan(meta)
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, backend))


@pytest.fixture(scope="module", params=[(k, m) for k in KINDS for m in ("llama", "qwen3")], ids=lambda p: "-".join(p))
def quantized(request, tmp_path_factory, paged_harness):
    kind, model_type = request.param
    path = tmp_path_factory.mktemp(f"{kind}-{model_type}")
    hf_model = write_quantized(kind, model_type, path)
    model, spec = load_model(str(path), torch.float32, torch.device("cpu"))

    def harness():
        return paged_harness(
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, num_pages=128
        )

    return SimpleNamespace(kind=kind, hf=hf_model, model=model, path=path, harness=harness)


def test_the_bake_check_passes_and_int4_formats_run_the_int4_kernel(quantized):
    assert check_checkpoint(str(quantized.path)).endswith("ForCausalLM")
    layer = quantized.model.model.layers[0]
    modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert all(isinstance(m, Int4Linear) == (quantized.kind in INT4) for m in modules)
    assert quantized.model.lm_head.weight.dtype == torch.float32  # left in float by every format here


def test_batch_of_mixed_prompts_then_decode_match_transformers(quantized):
    gen = torch.Generator().manual_seed(1)
    prompts = {
        r: torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()
        for r, n in (("a", 9), ("b", 1), ("c", 21))
    }
    harness = quantized.harness()
    logits = run_step(quantized.model, harness, list(prompts.items()))
    row = 0
    for tokens in prompts.values():
        ref = reference_logits(quantized.hf, tokens)
        torch.testing.assert_close(logits[row : row + len(tokens)], ref, atol=ATOL, rtol=1e-4)
        row += len(tokens)
    seqs = {r: list(t) for r, t in prompts.items()}
    for _ in range(5):  # greedy: each request takes its own argmax, which must be transformers' argmax too
        last = _last_rows(logits, seqs, prompts)
        nxt = {r: int(row.argmax()) for r, row in zip(seqs, last, strict=True)}
        logits = run_step(quantized.model, harness, [(r, [t]) for r, t in nxt.items()])
        for i, (r, t) in enumerate(nxt.items()):
            seqs[r].append(t)
            ref = reference_logits(quantized.hf, seqs[r])[-1]
            torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=1e-4)
            assert int(logits[i].argmax()) == int(ref.argmax())
        prompts = {r: [0] for r in seqs}  # from now on one row per request


def _last_rows(logits: torch.Tensor, seqs: dict, prompts: dict) -> list[torch.Tensor]:
    ends, row = [], 0
    for r in seqs:
        row += len(prompts[r])
        ends.append(logits[row - 1])
    return ends


def test_a_prompt_alone_equals_it_in_the_batch(quantized):
    tokens = torch.randint(0, TINY["vocab_size"], (17,), generator=torch.Generator().manual_seed(3)).tolist()
    alone = run_step(quantized.model, quantized.harness(), [("x", tokens)])
    batched = run_step(quantized.model, quantized.harness(), [("y", tokens[:5]), ("x", tokens)])
    torch.testing.assert_close(batched[5:], alone, atol=1e-5, rtol=1e-5)


def test_quantization_int4_on_a_quantized_checkpoint_is_refused(tmp_path):
    write_quantized("awq", "llama", tmp_path)
    with pytest.raises(UnsupportedModel, match="already awq: leave QUANTIZATION unset"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), quantization="int4")


def test_a_bitsandbytes_bake_fails_with_one_line(tmp_path):
    write_quantized("awq", "llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="'bitsandbytes' is not supported: the engine loads awq") as info:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_block_fp8_with_kv_projections_smaller_than_a_block_loads_as_transformers(model_type, tmp_path, paged_harness):
    """One KV head of 64: K and V hold 64 rows, half a 128-row scale block each, stacked with Q's 256."""
    hf = write_quantized("fp8_block", model_type, tmp_path, num_key_value_heads=1)
    assert check_checkpoint(str(tmp_path)).endswith("ForCausalLM")
    model, spec = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    harness = paged_harness(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    prompt = torch.randint(0, TINY["vocab_size"], (13,), generator=torch.Generator().manual_seed(6)).tolist()
    torch.testing.assert_close(
        run_step(model, harness, [("x", prompt)]), reference_logits(hf, prompt), atol=ATOL, rtol=1e-4
    )


@pytest.mark.parametrize("kind", ["awq", "fp8_block"])
def test_lora_on_a_quantized_base_matches_the_merged_dequantised_weights(kind, tmp_path, paged_harness):
    hf = write_quantized(kind, "llama", tmp_path / "model")
    tensors = write_adapter(
        tmp_path / "adapter",
        projection_shapes(hf.config),
        TINY["num_hidden_layers"],
        targets=ALL_TARGETS,
        rank=4,
        alpha=8.0,
        seed=1,
        std=0.3,
    )
    lora = LoraConfig({"a": str(tmp_path / "adapter")}, max_loras=1, max_lora_rank=4)
    model, spec = load_model(str(tmp_path / "model"), torch.float32, torch.device("cpu"), lora=lora)
    base = copy.deepcopy(hf)
    merge_into(hf, tensors, 8.0 / 4)
    prompt = torch.randint(0, TINY["vocab_size"], (11,), generator=torch.Generator().manual_seed(4)).tolist()
    model.lora.plan.update([(model.lora.slots["a"], len(prompt))], torch.device("cpu"))
    harness = paged_harness(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    logits = run_step(model, harness, [("x", prompt)])
    ref = reference_logits(hf, prompt)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-4)
    assert (ref - reference_logits(base, prompt)).abs().max() > 1e-2  # the adapter does change the answer
