"""A checkpoint's FP8 KV scales (compressed-tensors' kv_cache_scheme: self_attn.k_scale / v_scale; older
k_proj.output_scale): the bake accepts them, the loader sets them per layer, FP8 pages store K / k_scale and read
it back times k_scale (logits within the FP8 drift of float pages), and KV schemes the engine cannot run fail with
one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.kv_quant import FP8
from engine.attention.torch_ref import TorchRefBackend
from engine.errors import UnsupportedModel
from engine.model.loader import check_checkpoint, load_model
from tests.engine.model.quant_writers import TINY, write_quantized


def kv_amax(hf_model, tokens: list[int]) -> list[tuple[float, float]]:
    """Each layer's largest |K| and |V| (k_proj / v_proj outputs) on `tokens`: a static calibration."""
    found: list[list[float]] = [[0.0, 0.0] for _ in hf_model.model.layers]
    hooks = []
    for i, layer in enumerate(hf_model.model.layers):
        for j, proj in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj)):
            hooks.append(
                proj.register_forward_hook(
                    lambda _m, _i, out, i=i, j=j: found[i].__setitem__(j, max(found[i][j], float(out.abs().max())))
                )
            )
    with torch.no_grad():
        hf_model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return [(k, v) for k, v in found]


def add_kv_scales(
    path,
    scales: list[tuple[float, float]],
    names=("self_attn.k_scale", "self_attn.v_scale"),
    shape=(),
    scheme: dict | None = None,
) -> None:
    tensors = load_file(path / "model.safetensors")
    for i, pair in enumerate(scales):
        for name, value in zip(names, pair, strict=True):
            tensors[f"model.layers.{i}.{name}"] = torch.full(shape, value)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = scheme or {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    (path / "config.json").write_text(json.dumps(config))


def logits_on(model, spec, kv_dtype, tokens: list[int], paged_harness) -> torch.Tensor:
    harness = paged_harness(
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=kv_dtype
    )
    input_ids, positions, meta = harness.step([("a", tokens)])
    backend = TorchRefBackend("cpu")
    backend.plan(meta)
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, backend))


@pytest.mark.parametrize(
    "names",
    [("self_attn.k_scale", "self_attn.v_scale"), ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")],
)
def test_checkpoint_kv_scales_are_loaded_and_applied_on_both_sides(tmp_path, paged_harness, names):
    hf = write_quantized("ct_fp8", "llama", tmp_path)
    tokens = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(2)).tolist()
    # Calibrated as llm-compressor does (amax / 448): K and V fill e4m3's range; read back without the scale
    # they would be hundreds of times too large.
    scales = [(k / 448, v / 448) for k, v in kv_amax(hf, tokens)]
    add_kv_scales(tmp_path, scales, names)
    assert check_checkpoint(str(tmp_path)) == "LlamaForCausalLM"
    model, spec = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    got = [s for layer in model.model.layers for s in (layer.self_attn.k_scale, layer.self_attn.v_scale)]
    assert got == pytest.approx([s for pair in scales for s in pair], rel=1e-6) and max(got) < 0.05
    float_pages = logits_on(model, spec, torch.float32, tokens, paged_harness)
    drift = float((logits_on(model, spec, FP8, tokens, paged_harness) - float_pages).norm() / float_pages.norm())
    for layer in model.model.layers:  # the same pages at scale 1.0 (no calibration)
        layer.self_attn.k_scale = layer.self_attn.v_scale = 1.0
    unscaled = float((logits_on(model, spec, FP8, tokens, paged_harness) - float_pages).norm() / float_pages.norm())
    # Measured 0.12 and 0.11: e4m3 is as precise at any scale that keeps K and V in its normal range; a scale
    # applied on one side only would leave logits nowhere near float pages'.
    assert drift < 0.2 and drift < 1.2 * unscaled


def test_kv_schemes_the_engine_cannot_run_fail_with_one_line(tmp_path):
    write_quantized("ct_fp8", "llama", tmp_path / "int8")
    add_kv_scales(
        tmp_path / "int8",
        [(0.1, 0.1)] * 2,
        scheme={"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True},
    )
    with pytest.raises(UnsupportedModel, match="kv_cache_scheme 8-bit int per tensor is not supported"):
        check_checkpoint(str(tmp_path / "int8"))
    write_quantized("ct_fp8", "llama", tmp_path / "heads")
    add_kv_scales(tmp_path / "heads", [(0.1, 0.1)] * 2, shape=(TINY["num_key_value_heads"],))
    with pytest.raises(UnsupportedModel, match="only per-tensor KV scales are supported"):
        load_model(str(tmp_path / "heads"), torch.float32, torch.device("cpu"))
