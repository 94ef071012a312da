"""Gemma 4's MoE block (26B-A4B's shape in miniature) against transformers in float32: every layer runs its dense
GeGLU MLP beside top-2 of 8 GeGLU experts, routed by Gemma 4's router (weightless norm, learned scale, softmax,
renormalised top-k times per_expert_scale); global layers with their own head size and k = v; a window of 8.
Loaded from transformers' fused expert tensors, from one tensor per expert, and from a multimodal checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import UnsupportedModel
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.moe import StackedExperts
from engine.model.loader import check_checkpoint, load_model
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.model.family_parity import (
    ATOL,
    Pages,
    check_prefill_and_decode,
    greedy,
    hf_greedy,
    reference_logits,
    tiny_engine,
)

WINDOW = 8
S, F = "sliding_attention", "full_attention"
CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    layer_types=[S, F, S, F],
    sliding_window=WINDOW,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
    max_position_embeddings=256,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
)
GROUPS = [
    KVGroupSpec(layers=(0, 2), num_kv_heads=2, head_dim=16, window=WINDOW, scale=1.0, soft_cap=None),
    KVGroupSpec(layers=(1, 3), num_kv_heads=1, head_dim=32, window=None, scale=1.0, soft_cap=None),
]


def randomize(hf) -> None:
    """Weights large enough that parity means something and routing is decisive (router scores of about unit
    size, so that the top 2 of 8 are not near ties); per_expert_scale away from 1 so that it counts."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "scale" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "router.proj" in name else 0.15)


def save(hf, path, baked_model_path) -> None:
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(path)
    for name in TOKENIZER_FILES:  # the engine needs a tokenizer; the ids stay below the tiny vocabulary
        if (baked_model_path / name).exists() and name != "generation_config.json":
            shutil.copy(baked_model_path / name, path / name)


def split_experts(path) -> None:
    """Rewrites the fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] as one tensor per expert
    and projection (experts.{e}.gate_proj.weight, up_proj, down_proj)."""
    (file,) = path.glob("*.safetensors")
    state, out = load_file(str(file)), {}
    for name, t in state.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate[e], up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    save_file({k: v.contiguous() for k, v in out.items()}, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_moe():
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.Gemma4TextConfig(**CONFIG), attn_implementation="eager")
    randomize(hf.float().eval())
    return hf


@pytest.fixture(scope="module", params=["fused", "per_expert"])
def gemma4(request, hf_moe, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("gemma4-moe-" + request.param)
    save(hf_moe, path, baked_model_path)
    names = load_file(str(next(path.glob("*.safetensors")))).keys()
    assert any(n.endswith("layers.0.experts.gate_up_proj") for n in names)  # what save_pretrained writes
    if request.param == "per_expert":
        split_experts(path)
    model, spec = load_model(str(path), torch.float32, torch.device("cpu"))
    return SimpleNamespace(hf=hf_moe, model=model, spec=spec, path=path, layout=request.param)


def test_the_bake_check_passes_and_every_layer_has_experts(gemma4):
    assert check_checkpoint(str(gemma4.path)) == "Gemma4ForCausalLM"
    assert gemma4.spec.kv_groups == GROUPS
    for ours, ref in zip(gemma4.model.model.layers, gemma4.hf.model.layers, strict=True):
        assert isinstance(ours.experts, StackedExperts) and ours.experts.num_experts == 8
        torch.testing.assert_close(ours.experts.gate_up_proj, ref.experts.gate_up_proj, atol=0, rtol=0)
        torch.testing.assert_close(ours.router.per_expert_scale, ref.router.per_expert_scale, atol=0, rtol=0)


def test_prefill_lengths_and_decode_past_the_window(gemma4):
    check_prefill_and_decode(gemma4.model, gemma4.spec, gemma4.hf, decode_steps=6)  # 5 + 6 crosses the window


def test_engine_greedy_equals_transformers_batched_and_solo(gemma4):
    gen = torch.Generator().manual_seed(2)
    prompts = {f"p{n}": torch.randint(3, 128, (n,), generator=gen).tolist() for n in (2, 11, 21)}
    batched = greedy(tiny_engine(gemma4.path), prompts, 8)
    for r, prompt in prompts.items():
        assert batched[r] == hf_greedy(gemma4.hf, prompt, 8), r
        assert greedy(tiny_engine(gemma4.path), {r: prompt}, 8) == {r: batched[r]}


def test_multimodal_moe_checkpoint_serves_its_text_model(tmp_path, baked_model_path):
    import transformers as tf

    text = {**CONFIG, "num_hidden_layers": 2, "layer_types": [S, F]}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    hf = tf.AutoModelForImageTextToText.from_config(
        tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None), attn_implementation="eager"
    )
    randomize(hf.float().eval())
    save(hf, tmp_path, baked_model_path)
    assert check_checkpoint(str(tmp_path)) == "Gemma4ForConditionalGeneration"
    model, spec = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    prompts = {"a": list(range(3, 8)), "b": list(range(10, 30))}
    logits = Pages(spec.kv_groups).run(model, list(prompts.items()))
    torch.testing.assert_close(logits[:5], reference_logits(hf, prompts["a"]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[5:], reference_logits(hf, prompts["b"]), atol=ATOL, rtol=1e-4)


def _with_config(src, dst, **change):
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **change}))
    return str(dst)


# A checkpoint of 8 experts under a config that counts another number: the first tensor that disagrees is named.
FUSED_COUNT = r"tensor 'model\.layers\.0\.experts\.down_proj' has shape \(8, 64, 32\), expected \({}, 64, 32\)"
WRONG_COUNT = {
    ("fused", 6): FUSED_COUNT.format(6),
    ("fused", 12): FUSED_COUNT.format(12),
    ("per_expert", 6): r"unexpected tensor 'model\.layers\.0\.experts\.6\.down_proj\.weight' in checkpoint",
    ("per_expert", 12): r"tensor 'model\.layers\.0\.router\.per_expert_scale' has shape \(8,\), expected \(12,\)",
}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_experts": 6}, None),
        ({"num_experts": 12}, None),
        ({"top_k_experts": 9}, r"top_k_experts=9 must be in 1\.\.8 \(num_experts\)"),
        ({"num_experts": None}, r"enable_moe_block needs a positive integer num_experts \(got None\)"),
        ({"moe_intermediate_size": 0}, r"enable_moe_block needs a positive integer moe_intermediate_size \(got 0\)"),
    ],
)
def test_a_wrong_expert_config_fails_the_bake_in_one_line(gemma4, tmp_path, change, message):
    folder = _with_config(gemma4.path, tmp_path, **change)
    with pytest.raises(UnsupportedModel) as info:
        check_checkpoint(folder)
    text = str(info.value)
    assert "\n" not in text
    assert re.search(message or WRONG_COUNT[gemma4.layout, change["num_experts"]], text), text
