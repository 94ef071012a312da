"""What the bake and the loader refuse or accept on a mixture-of-experts model: routing schemes the MoE layer does
not implement (one line naming the config key; for GLM-4.5, one its reference does not run), LoRA on the attention
projections (applied exactly) and LoRA on experts (refused in one line)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import LoraConfig
from engine.errors import UnsupportedModel
from engine.model.adapters import projection_shapes
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.moe_checkpoints import build_moe_checkpoint
from tests.lora_adapters import merge_into, write_adapter


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    return path, build_moe_checkpoint("qwen3_moe", "hub", path)


def _with_config(src, dst, **change):
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config.update(change)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "key,value",
    [
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
        ("n_group", 8),
        ("topk_group", 4),
        ("routed_scaling_factor", 2.5),
    ],
)
def test_unsupported_routing_fails_the_check_naming_the_key(qwen3_moe, tmp_path, key, value):
    folder = _with_config(qwen3_moe[0], tmp_path, **{key: value})
    with pytest.raises(UnsupportedModel, match=f"MoE routing {key}=") as err:
        check_checkpoint(str(folder))
    assert "\n" not in str(err.value)


def test_the_supported_routing_passes_the_check(qwen3_moe, tmp_path):
    folder = _with_config(qwen3_moe[0], tmp_path, scoring_func="softmax", topk_method="greedy", n_group=1)
    assert check_checkpoint(str(folder)) == "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4-moe")
    build_moe_checkpoint("glm4_moe", "hub", path)
    return path


@pytest.mark.parametrize(
    "change,named",
    [
        ({"scoring_func": "softmax"}, "MoE routing scoring_func='softmax' is not supported"),
        ({"topk_method": "group_limited_greedy"}, "MoE routing topk_method='group_limited_greedy' is not supported"),
        ({"n_group": 3}, "n_group=3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
            "rope type 'longrope' needs short_factor and long_factor and original_max_position_embeddings",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.1875}},
            "partial_rotary_factor=0.1875 does not give an even rotary width",
        ),
    ],
)
def test_a_glm4_moe_knob_the_engine_does_not_run_fails_the_check_in_one_line(glm4_moe, tmp_path, change, named):
    folder = _with_config(glm4_moe, tmp_path, **change)
    with pytest.raises(UnsupportedModel, match=named) as err:
        check_checkpoint(str(folder))
    assert "\n" not in str(err.value)


def test_the_glm4_moe_routing_passes_the_check(glm4_moe, tmp_path):
    folder = _with_config(glm4_moe, tmp_path, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2)
    assert check_checkpoint(str(folder)) == "Glm4MoeForCausalLM"


def test_top_k_above_the_expert_count_is_refused(qwen3_moe, tmp_path):
    folder = _with_config(qwen3_moe[0], tmp_path, num_experts_per_tok=9)
    with pytest.raises(UnsupportedModel, match="num_experts_per_tok=9"):
        check_checkpoint(str(folder))


def test_lora_on_attention_of_an_moe_model_is_applied_exactly(qwen3_moe, tmp_path, paged_harness):
    from engine.attention.torch_ref import TorchRefBackend

    path, hf = qwen3_moe
    shapes = projection_shapes(hf.config)
    assert set(shapes) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    tensors = write_adapter(tmp_path / "attn", shapes, hf.config.num_hidden_layers, targets=list(shapes), std=0.1)
    model, spec = load_model(
        str(path), torch.float32, torch.device("cpu"), lora=LoraConfig(adapters={"attn": str(tmp_path / "attn")})
    )
    tokens = [3, 9, 27, 81, 100, 7]
    harness = paged_harness(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    input_ids, positions, meta = harness.step([("x", tokens)])
    model.lora.plan.update([(0, len(tokens))], torch.device("cpu"))
    backend = TorchRefBackend("cpu")
    backend.plan(meta)
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, backend))
    merge_into(hf, tensors, scale=8.0 / 4)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "key",
    [
        "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.gate.lora_A.weight",
        "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight",
    ],
)
def test_lora_on_experts_is_refused_in_one_line(qwen3_moe, tmp_path, key):
    from safetensors.torch import save_file

    path, hf = qwen3_moe
    folder = tmp_path / "experts"
    write_adapter(folder, projection_shapes(hf.config), hf.config.num_hidden_layers, targets=["q_proj"])
    save_file(
        {key: torch.zeros(4, 64), key.replace("lora_A", "lora_B"): torch.zeros(32, 4)},
        str(folder / "adapter_model.safetensors"),
    )
    with pytest.raises(
        UnsupportedModel,
        match="MoE expert or router; on a mixture-of-experts model only q_proj, k_proj, v_proj, o_proj take LoRA",
    ) as err:
        load_model(str(path), torch.float32, torch.device("cpu"), lora=LoraConfig(adapters={"e": str(folder)}))
    assert "\n" not in str(err.value)
